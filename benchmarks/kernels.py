"""Which matmul kernel is fastest for the linear layers of the default model, per row count?

Decode is bandwidth-bound: every step streams all weights from memory, so the kernels
are timed the way the model uses them -- one pass over all 30 layers' matrices (fused
q/k/v and gate/up, 425 MB of fp32, far larger than any cache) with the same input rows,
plus the LM head. Side by side in one run:

- ``torch``: ``F.linear(x, W)`` (MKL on CPU);
- ``np_xwt``: numpy ``x @ W.T`` on zero-copy views (OpenBLAS);
- ``np_wxt``: numpy ``(W @ x.T).T`` (OpenBLAS, the other operand order).

Prints ms per pass, effective GB/s (weight bytes / time), and each variant's ratio to
torch. ``servelab.model.linear`` routes row counts up to ``NUMPY_MAX_ROWS`` to numpy on
CPU; the table is where that threshold comes from. Figures are provisional whenever
other work shares the machine: compare ratios within one run, never absolute numbers.

Usage: python benchmarks/kernels.py [--rows 1,4,16,64,256] [--threads N] [--repeat 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from threadpoolctl import threadpool_limits

# (name, out_features, in_features) of one SmolLM2-135M layer with fused q/k/v and gate/up.
LAYER_SHAPES = [
    ("qkv", 960, 576),
    ("o_proj", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
]
LM_HEAD = (49152, 576)
NUM_LAYERS = 30


def _best(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: page in, thread pools up
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def variants(mats: list[torch.Tensor], rows: int) -> dict[str, Callable[[], object]]:
    xs = {m.shape[1]: torch.randn(rows, m.shape[1]) for m in mats}
    xs_np = {k: v.numpy() for k, v in xs.items()}
    w_np = [m.numpy() for m in mats]
    return {
        "torch": lambda: [F.linear(xs[m.shape[1]], m) for m in mats],
        "np_xwt": lambda: [xs_np[w.shape[1]] @ w.T for w in w_np],
        "np_wxt": lambda: [np.ascontiguousarray((w @ xs_np[w.shape[1]].T).T) for w in w_np],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    layer_mats = [torch.randn(o, i) for _ in range(NUM_LAYERS) for _, o, i in LAYER_SHAPES]
    head = [torch.randn(*LM_HEAD)]
    gb_layers = sum(m.numel() for m in layer_mats) * 4 / 1e9
    with threadpool_limits(limits=args.threads, user_api="blas"):
        print(
            f"threads={args.threads} (torch and OpenBLAS), best of {args.repeat}; "
            f"layers = {NUM_LAYERS} x (qkv, o, gate_up, down) = {gb_layers * 1e3:.0f} MB"
        )
        for label, mats, max_rows in (("layers", layer_mats, 1 << 30), ("lm_head", head, 64)):
            print(f"\n{label}: ms per pass (GB/s of weights) and ratio to torch")
            for rows in (int(r) for r in args.rows.split(",")):
                if rows > max_rows:
                    continue  # logits are only computed at sampled positions
                gb = sum(m.numel() for m in mats) * 4 / 1e9
                times = {k: _best(fn, args.repeat) for k, fn in variants(mats, rows).items()}
                cells = "  ".join(
                    f"{k} {t * 1e3:7.1f} ({gb / t:4.1f}) x{t / times['torch']:.2f}"
                    for k, t in times.items()
                )
                print(f"rows {rows:>4}: {cells}")


if __name__ == "__main__":
    main()
