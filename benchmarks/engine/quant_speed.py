"""How fast are the weight modes (none, q8_0, q4_1), each beside its own floor, in one run?

Same model, same thread count, machine limits measured in the same run:

- decode ms a step at batch 1 / 8 / 16 / 32 (steps that only decode, 128-token contexts), beside
  its floor: the bytes a decode step reads (every layer's weights in the mode's format, the
  norms and the LM head) over the streaming read bandwidth measured at the start;
- prefill tok/s at 256 and 1024 tokens (one chunk), beside its ceiling: 2 FLOP per
  decoder-layer weight per token at the fp32 GEMM rate measured here (attention not
  counted; the integer-dot kinds can pass it).

The modes' own figures move with other load on a shared machine, so all three engines are
built first and measured in ``--rounds`` alternating rounds (the order rotating), each figure
the best of its rounds: read the ratios.

Usage: python -m benchmarks.engine.quant_speed [--model smollm2-135m] [--threads 2] [--rounds 3]
       [--quick]
"""

from __future__ import annotations

import servelab  # noqa: F401  (first: it sets OMP_WAIT_POLICY before torch loads OpenMP)

# isort: split
import argparse

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.engine.engine_speed import (
    Sizes,
    flop_per_token,
    gemm_flops,
    read_bandwidth,
    servelab_figures,
    step_bytes,
)
from servelab.engine.config import EngineConfig
from servelab.engine.engine import LLMEngine
from servelab.model.loader import load_model
from servelab.model.quant import MODES
from servelab.model.runner import TorchModelRunner
from servelab.server.heap import keep_step_buffers

console = Console(width=150)
SIZES = Sizes((256, 1024), (1, 8, 16, 32), 128, 8, 4, 32, 8, 0, 2)
QUICK = Sizes((64, 128), (1, 4), 32, 4, 2, 16, 4, 0, 1)


def main() -> None:
    keep_step_buffers()  # the engine core's heap policy: measure what the server runs
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds, best kept")
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the script runs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sz = QUICK if args.quick else SIZES
    cpu = torch.device("cpu")
    bandwidth = read_bandwidth(cpu, 5)
    engines: dict[str, tuple[int, LLMEngine]] = {}
    flops = per_token = 0.0
    vocab = 0
    for mode in MODES:
        loaded = load_model(args.model, device="cpu", quantization=mode)
        c = loaded.config
        if not flops:
            q_out = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
            flops = gemm_flops(c.hidden_size, c.intermediate_size, q_out, 512, cpu, 5)
            per_token = flop_per_token(c)
            vocab = c.vocab_size
        runner = TorchModelRunner(loaded, device="cpu", num_threads=args.threads)
        # No prefix caching: later rounds send the same prompts, and must compute them again.
        config = EngineConfig(
            max_num_batched_tokens=max(2048, *sz.prefill_lens),
            kv_cache_memory_gb=0.5,
            enable_prefix_caching=False,
        )
        engines[mode] = (step_bytes(loaded.model), LLMEngine(runner, config, loaded.tokenizer))
    best: dict[str, dict[str, float]] = {m: {} for m in MODES}
    for r in range(args.rounds):
        for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:
            console.print(f"round {r + 1}: {mode}...")
            for key, v in servelab_figures(engines[mode][1], sz, vocab).items():
                keep = min if key.startswith("decode_") else max  # times vs rates
                best[mode][key] = keep(v, best[mode].get(key, v))
    rows = {m: (engines[m][0], best[m]) for m in MODES}
    after = read_bandwidth(cpu, 5)
    console.print(
        f"read {bandwidth:.1f} GB/s at the start, {after:.1f} at the end; fp32 GEMM "
        f"{flops / 1e9:.1f} GFLOP/s (512 rows) -> prefill ceiling "
        f"{flops / per_token:,.0f} tok/s before attention; {args.threads} threads, "
        f"best of {args.rounds} alternating rounds"
    )
    t = Table(title="weight modes side by side (provisional on a shared machine: read ratios)")
    t.add_column("figure")
    for mode in MODES:
        t.add_column(mode, justify="right")
    t.add_row("bytes read a decode step", *(f"{rows[m][0] / 1e6:.0f} MB" for m in MODES))
    for b in sz.decode_batches:
        cells = []
        for m in MODES:
            nbytes, fig = rows[m]
            floor = nbytes / (bandwidth * 1e9)
            cells.append(
                f"{fig[f'decode_{b}'] * 1e3:.1f} ({fig[f'decode_{b}'] / floor:.1f}x floor)"
            )
        t.add_row(f"decode step, batch {b} (ms)", *cells)
    for n in sz.prefill_lens:
        cells = [
            f"{rows[m][1][f'prefill_{n}']:,.0f} "
            f"({rows[m][1][f'prefill_{n}'] * per_token / flops:.0%} of GEMM)"
            for m in MODES
        ]
        t.add_row(f"prefill {n} tokens (tok/s)", *cells)
    base = rows["none"][1]
    for m in MODES[1:]:
        t.add_row(
            f"{m} speed-up over none",
            "",
            *[""] * (MODES.index(m) - 1),
            " / ".join(
                f"{base[f'decode_{b}'] / rows[m][1][f'decode_{b}']:.2f}x" for b in sz.decode_batches
            ),
            *[""] * (len(MODES) - 1 - MODES.index(m)),
        )
    console.print(t)


if __name__ == "__main__":
    main()
