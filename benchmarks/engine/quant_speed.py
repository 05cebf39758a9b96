"""How fast are the weight modes (none, bf16, q8_0, q4_1), each beside its own floor, in one run?

Same model, same thread count, machine limits measured in the same run:

- decode ms a step at batch 1 / 8 / 16 / 32 (steps that only decode, 128-token contexts), beside
  its floor: the bytes a decode step reads (every layer's weights in the mode's format, the
  norms and the LM head) over the streaming read bandwidth measured at the start;
- prefill tok/s at 256 and 1024 tokens (one chunk), beside its ceiling: 2 FLOP per
  decoder-layer weight per token (the simulator's ``ModelSpec.flops_per_token``) at the fp32
  GEMM rate measured here (attention not counted; the integer-dot kinds and bf16 can pass it).

The modes' own figures move with other load on a shared machine, so every mode's engine is
built first and measured in ``--rounds`` alternating rounds (the order rotating), each figure
the best of its rounds: read the ratios.

Usage: python -m benchmarks.engine.quant_speed [--model smollm2-135m] [--threads 2] [--rounds 3]
       [--quick]
"""

from __future__ import annotations

import servelab.model  # noqa: F401  (first: it sets OMP_WAIT_POLICY before torch loads OpenMP)

# isort: split
import argparse
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.common import Sizes, decode_bytes, engine_figures, gemm_rate, read_bandwidth
from servelab.engine.engine import LLMEngine
from servelab.engine.engine_config import EngineConfig
from servelab.model.loader import load_model
from servelab.model.quant import MODES
from servelab.model.torch_runner import TorchModelRunner
from servelab.server.heap import keep_step_buffers
from servelab.sim.costs.model_shapes import from_model_config

console = Console(width=150)
NO_HF = {"hf_seq": 0}
SIZES = Sizes(
    prefill_lens=(256, 1024), decode_batches=(1, 8, 16, 32), decode_ctx=128, decode_steps=8,
    tput_requests=4, tput_in=32, tput_out=8, repeat=2, **NO_HF,
)  # fmt: skip
QUICK = Sizes(
    prefill_lens=(64, 128), decode_batches=(1, 4), decode_ctx=32, decode_steps=4,
    tput_requests=2, tput_in=16, tput_out=4, repeat=1, **NO_HF,
)  # fmt: skip


@dataclass(kw_only=True)
class Figures:
    """Each mode's decode-step bytes and best figures, and the limits around them."""

    sizes: Sizes
    rounds: int
    threads: int
    bandwidth: float  # GB/s, at the start
    bandwidth_after: float  # GB/s, at the end
    gemm: float  # fp32 FLOP/s at 512 rows
    per_token: float  # the layers' FLOPs a token
    step_bytes: dict[str, float]
    best: dict[str, dict[str, float]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds, best kept")
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the script runs")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> Figures:
    torch.set_num_threads(args.threads)
    sz = QUICK if args.quick else SIZES
    cpu = torch.device("cpu")
    bandwidth = read_bandwidth(cpu, 5)
    engines: dict[str, LLMEngine] = {}
    nbytes: dict[str, float] = {}
    for mode in MODES:
        loaded = load_model(args.model, device="cpu", quantization=mode)
        spec = from_model_config(loaded.config, args.model)
        if not engines:
            gemm = gemm_rate(spec, 512, cpu, 5)
        runner = TorchModelRunner(loaded, device="cpu", num_threads=args.threads)
        # No prefix caching: later rounds send the same prompts, and must compute them again.
        config = EngineConfig(
            max_num_batched_tokens=max(2048, *sz.prefill_lens),
            kv_cache_memory_gb=0.5,
            enable_prefix_caching=False,
        )
        nbytes[mode] = decode_bytes(spec, loaded.model)
        engines[mode] = LLMEngine(runner, config, loaded.tokenizer)
    best: dict[str, dict[str, float]] = {m: {} for m in MODES}
    for r in range(args.rounds):
        for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:
            console.print(f"round {r + 1}: {mode}...")
            for key, v in engine_figures(engines[mode], sz, spec.vocab).items():
                keep = min if key.startswith("decode_") else max  # times vs rates
                best[mode][key] = keep(v, best[mode].get(key, v))
    return Figures(
        sizes=sz,
        rounds=args.rounds,
        threads=args.threads,
        bandwidth=bandwidth,
        bandwidth_after=read_bandwidth(cpu, 5),
        gemm=gemm,
        per_token=spec.flops_per_token,
        step_bytes=nbytes,
        best=best,
    )


def show(f: Figures) -> None:
    console.print(
        f"read {f.bandwidth:.1f} GB/s at the start, {f.bandwidth_after:.1f} at the end; fp32 "
        f"GEMM {f.gemm / 1e9:.1f} GFLOP/s (512 rows) -> prefill ceiling "
        f"{f.gemm / f.per_token:,.0f} tok/s before attention; {f.threads} threads, "
        f"best of {f.rounds} alternating rounds"
    )
    t = Table(title="weight modes side by side (provisional on a shared machine: read ratios)")
    t.add_column("figure")
    for mode in MODES:
        t.add_column(mode, justify="right")
    t.add_row("bytes read a decode step", *(f"{f.step_bytes[m] / 1e6:.0f} MB" for m in MODES))
    for b in f.sizes.decode_batches:
        cells = []
        for m in MODES:
            floor = f.step_bytes[m] / (f.bandwidth * 1e9)
            step = f.best[m][f"decode_{b}"]
            cells.append(f"{step * 1e3:.1f} ({step / floor:.1f}x floor)")
        t.add_row(f"decode step, batch {b} (ms)", *cells)
    for n in f.sizes.prefill_lens:
        cells = [
            f"{f.best[m][f'prefill_{n}']:,.0f} "
            f"({f.best[m][f'prefill_{n}'] * f.per_token / f.gemm:.0%} of GEMM)"
            for m in MODES
        ]
        t.add_row(f"prefill {n} tokens (tok/s)", *cells)
    base = f.best["none"]
    for m in MODES[1:]:
        t.add_row(
            f"{m} speed-up over none",
            "",
            *[""] * (MODES.index(m) - 1),
            " / ".join(
                f"{base[f'decode_{b}'] / f.best[m][f'decode_{b}']:.2f}x"
                for b in f.sizes.decode_batches
            ),
            *[""] * (len(MODES) - 1 - MODES.index(m)),
        )
    console.print(t)


def main(argv: list[str] | None = None) -> None:
    keep_step_buffers()  # the engine core's heap policy: measure what the server runs
    show(run(parse_args(argv)))


if __name__ == "__main__":
    main()
