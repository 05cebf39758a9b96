"""The linear products alone: fp32 (plain and interleaved) against Q4_1 blocks with fp32 inputs
and Q4_1 by integer dots.

Over ``--layers`` layers' worth of SmolLM2's four products (qkv 960x576, o 576x576, gate_up
3072x576, down 576x1536), each layer its own copy (so the weights come from memory, as in a
decode step), at each row count in ``--rows``: ``linear`` on fp32 weights in the plain layout
(servelab's kernel up to 32 rows, oneDNN above) and interleaved by 16 rows (``f32x16``, what
the model holds where the AVX-512 kernels are built), on Q4_1 blocks (``q4_1``: dequantised in registers, on panels,
or to fp32 for oneDNN, by row count) and on the same blocks interleaved for integer dots
(``q4_1x16``, AVX512-VNNI builds only). Random blocks; best of ``--repeat``; the GFLOP/s
column counts 2 per weight per row, so integer dots can read above the fp32 GEMM rate.

Usage: taskset -c 1 python -m benchmarks.engine.qlinear_speed [--threads 1]
       [--rows 1,8,32,256,1024] [--layers 10] [--repeat 3]
"""

from __future__ import annotations

import servelab.model  # noqa: F401  (first: it sets OMP_WAIT_POLICY before torch loads OpenMP)

# isort: split
import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.common import layer_shapes
from servelab.model import cpu_kernels, quant
from servelab.model.linear import linear
from servelab.model.quant import QuantWeight
from servelab.sim.costs.model_shapes import PRESETS

SHAPES = [(o, i) for _, o, i in layer_shapes(PRESETS["smollm2-135m"])]  # (out, in) features


def random_q4_1(n: int, k: int, g: torch.Generator) -> QuantWeight:
    nb = k // 32
    b = torch.randint(0, 256, (n, nb, 20), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, nb, 1, generator=g) * 0.02 + 0.001).to(torch.float16)
    m = (-torch.rand(n, nb, 1, generator=g) * 0.1).to(torch.float16)
    b[..., 0:2] = d.view(torch.uint8).view(n, nb, 2)
    b[..., 2:4] = m.view(torch.uint8).view(n, nb, 2)
    return QuantWeight("q4_1", b.reshape(n, -1).contiguous(), k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,8,32,256,1024")
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("servelab's CPU kernels are not built here (see the warning above)")
    torch.set_num_threads(a.threads)
    cpu_kernels.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    blocks = [[random_q4_1(n, k, g) for n, k in SHAPES] for _ in range(a.layers)]
    fp32 = [[cpu_kernels.dequantize(w) for w in ws] for ws in blocks]
    kinds: dict[str, list] = {"fp32": fp32}
    if cpu_kernels.fp32_interleave_available():
        kinds["f32x16"] = [[quant.interleave_f32(w) for w in ws] for ws in fp32]
    kinds["q4_1"] = blocks
    if cpu_kernels.int8_dot_available():
        kinds["q4_1x16"] = [[quant.interleave(w) for w in ws] for ws in blocks]
    flops_per_row = 2 * sum(n * k for n, k in SHAPES) * a.layers
    t = Table(title=f"{a.layers} layers' products, {a.threads} thread(s): ms (GFLOP/s)")
    t.add_column("rows", justify="right")
    for name in kinds:
        t.add_column(name, justify="right")
    for m in [int(r) for r in a.rows.split(",")]:
        xs = {k: torch.randn(m, k, generator=g) for _, k in SHAPES}
        cells = []
        for weights in kinds.values():
            best = float("inf")
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                for ws in weights:
                    for (_, k), w in zip(SHAPES, ws):
                        linear(xs[k], w)
                best = min(best, time.perf_counter() - t0)
            cells.append(f"{best * 1e3:.2f} ({flops_per_row * m / best / 1e9:.0f})")
        t.add_row(str(m), *cells)
    Console().print(t)


if __name__ == "__main__":
    main()
