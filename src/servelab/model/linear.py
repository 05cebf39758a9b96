"""Matrix products of the linear layers, routed to the fastest kernel per shape.

On this class of CPU (AMD, AVX2) MKL's fp32 GEMM/GEMV behind ``F.linear`` streams
weights at ~60% of numpy/OpenBLAS's speed for 1-row products (decode) and is
pathological for 2-16 rows; OpenBLAS was as fast or faster at every row count measured
(``benchmarks/kernels.py``). So on CPU, fp32 products go through numpy on zero-copy
views of the same storage: ``W @ x.T`` up to ``WXT_MAX_ROWS`` rows (OpenBLAS' best
operand order there), ``x @ W.T`` above. Other devices use ``F.linear``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

WXT_MAX_ROWS = 16
use_numpy_on_cpu = True  # benchmarks flip this to compare against stock kernels


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + b`` for 2-D ``x`` ([rows, in]) and ``w`` ([out, in])."""
    if not (use_numpy_on_cpu and x.device.type == "cpu" and x.dtype == torch.float32):
        return F.linear(x, w, b)
    xn = x.contiguous().numpy()
    wn = w.numpy()
    if xn.shape[0] <= WXT_MAX_ROWS:
        y = torch.from_numpy(np.ascontiguousarray(np.matmul(wn, xn.T).T))
    else:
        y = torch.from_numpy(np.matmul(xn, wn.T))
    if b is not None:
        y += b
    return y
