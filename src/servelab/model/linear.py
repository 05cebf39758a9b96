"""Matrix products of the linear layers, routed to the fastest kernel per shape.

On this class of CPU (AMD) MKL's fp32 GEMV behind ``F.linear`` streams weights at ~60%
of the memory bandwidth for 1-row products (decode) and is pathological for 2-16 rows
(``benchmarks/kernel_speed.py``). So on CPU, fp32 products of up to ``cpu_kernels.MAX_ROWS``
rows (decode, drafts) go to servelab's own kernel, which reads each weight once per step
for any row count; where it is not built, up to 16 rows go to numpy/OpenBLAS ``W @ x.T``
on zero-copy views (its best operand order for few rows).

Where servelab's AVX-512 kernels are built, the model holds its fp32 weights interleaved by
16 rows (``quant.interleave_f32``, kind ``f32x16``) and every product, decode or prefill,
goes to servelab's kernel for that layout: on one Zen 5 core it ran a layer's products at
229-238 GFLOP/s at 256-1024 rows, above oneDNN's 212-217 on the plain weight, and streamed
32-row products from memory at ~180 GFLOP/s against ~140 for the plain layout's tiles.
The paths below serve the plain layout: AVX2-only builds, other dtypes, shapes whose rows
are not a multiple of 16.

Prefill-sized products go to oneDNN's linear on the plain [out, in] weight
(``torch.ops.mkldnn._linear_pointwise``), the residual add fused as its post-op: on one
AMD Zen 4 core it ran 10-20% faster than MKL's ``F.linear`` and 5-10% faster than
OpenBLAS at 64-2048 rows (``benchmarks/kernel_speed.py --gemm``). Unlike OpenBLAS it runs on
torch's own OpenMP pool, so attention and the other torch ops that follow never wait for a
second pool's threads to yield the cores. Where torch lacks oneDNN, ``F.linear``. Other
devices use ``F.linear``.

Quantised weights (``quant.QuantWeight``, CPU only) take servelab's quantised kernel for
up to ``MAX_ROWS`` rows; above that the matrix is dequantised once into fp32 and goes to
the same GEMM as any prefill product (dequantising costs one pass over the weights, small
beside a GEMM of more than 32 rows). Blocks interleaved for integer dots (``q4_1x16``,
``q8_0x16``) take their own kernel at every row count, as ``f32x16`` does: it does the
GEMM's work in int8 at about three times oneDNN's fp32 rate.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

from servelab.model import cpu_kernels
from servelab.model.quant import QuantWeight

use_numpy_on_cpu = True  # benchmarks flip this to compare against stock kernels
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
# oneDNN keeps a compiled primitive per product shape, and torch's ideep layer a second
# cache of them, 1024 entries each by default: every new prefill length is a new shape, so a
# server's RSS grows by ~1 MB per length seen. Both are read when the first primitive is
# made, so setting them here, before any product, is enough. 16 entries hold every shape of
# a step (a few weights, two post-ops), and re-making a primitive for a new length costs no
# measurable time; a larger cache only holds more memory (docs/design/server.md, "Soak").
_PRIMITIVE_CACHE_ENTRIES = "16"
for _var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_var, _PRIMITIVE_CACHE_ENTRIES)


def linear(
    x: torch.Tensor,
    w: torch.Tensor | QuantWeight,
    b: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ w.T + b`` for 2-D ``x`` ([rows, in]) and ``w`` ([out, in]).

    With ``residual`` ([rows, out], contiguous, no ``b``) the product is added to it and
    the sum returned, in place or not: the decoder's residual adds then cost nothing extra
    (the CPU kernel adds as it stores, oneDNN as a post-op, BLAS with beta = 1).
    """
    if residual is not None:
        assert b is None, "a residual product takes no bias"
    if isinstance(w, QuantWeight):
        if x.shape[0] <= cpu_kernels.MAX_ROWS or w.interleaved:
            return cpu_kernels.qlinear(x, w, b, residual)
        w = cpu_kernels.dequantize(w)
    routed = use_numpy_on_cpu and x.device.type == "cpu" and x.dtype == torch.float32
    rows = x.shape[0]
    if routed and rows <= cpu_kernels.MAX_ROWS and cpu_kernels.available():
        return cpu_kernels.linear(x, w, b, residual)
    if routed and rows <= 16:
        y = torch.from_numpy(np.matmul(w.numpy(), x.contiguous().numpy().T).T)
        if residual is not None:
            return residual.add_(y)
        y = y.contiguous()
        return y.add_(b) if b is not None else y
    if routed and _ONEDNN:
        x = x.contiguous()
        if residual is not None:
            return torch.ops.mkldnn._linear_pointwise(x, residual, w, None, "add")
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    if residual is not None:
        return residual.addmm_(x, w.t())
    return F.linear(x, w, b)
