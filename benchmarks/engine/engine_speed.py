"""How fast is the servelab engine, against HF transformers and against the machine's limits?

One run, same fp32 weights (the GGUF's dequantised HF directory), same thread count:

- the machine's limits, measured first: streaming read bandwidth (a torch sum over 512 MB)
  -> the decode floor (weight bytes / bandwidth, every step reads all weights); fp32 GEMM
  FLOP/s (``benchmarks.common.gemm_rate``, at prefill shapes) -> the prefill ceiling: the
  prompt's FLOPs as the simulator's ``ModelSpec`` counts them (2 per layer weight per token,
  ~212 MFLOP for SmolLM2-135M, plus causal attention's score and value products, 4 * heads *
  head_dim per visible key per layer: +8% at 512 tokens, +33% at 2048, plus the LM head at
  the one position that samples), all at the measured GEMM rate;
- prefill tokens/s at 512- and 2048-token prompts (one request, one chunk);
- decode step time at batch 1, 8 and 32 (256-token prompts; steps that only decode);
- output tokens/s for 64 requests of 256 in / 64 out, all submitted at once, against HF
  ``generate`` one request after another (4 of them, 2 with ``--quick``: HF's rate per
  request does not depend on how many run in sequence).

Targets (printed with each figure): decode at batch 1 <= 1.5x the floor; prefill >= 80% of
the matmul rate; batched output throughput >= 4x HF sequential.

Figures are provisional whenever other work shares the machine: read the ratios, which are
measured side by side in one run, not the absolute numbers.

Usage: python -m benchmarks.engine.engine_speed [--model smollm2-135m] [--threads N]
       [--device cpu] [--no-hf] [--quick]   (--quick: small sizes, to check that it runs)
"""

from __future__ import annotations

import servelab.model  # noqa: F401  (first: it sets OMP_WAIT_POLICY before torch loads OpenMP)

# isort: split
import argparse
import gc
import random
import statistics
import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.common import (
    Sizes,
    decode_bytes,
    engine_figures,
    gemm_rate,
    prefill_flops,
    random_prompt,
    read_bandwidth,
    sync,
)
from servelab.engine.engine import LLMEngine
from servelab.engine.engine_config import EngineConfig
from servelab.model.loader import load_model
from servelab.model.torch_runner import TorchModelRunner
from servelab.model.weight_cache import cached_hf_dir
from servelab.modelcore.catalogue import is_gguf, resolve_model
from servelab.server.heap import keep_step_buffers
from servelab.sim.costs.model_shapes import from_model_config

console = Console(width=150)
QUICK = Sizes(
    prefill_lens=(64, 128),
    decode_batches=(1, 4),
    decode_ctx=64,
    decode_steps=4,
    tput_requests=8,
    tput_in=32,
    tput_out=8,
    hf_seq=2,
    repeat=1,
)


# ---- HF transformers ----


class _StepTimes:
    """A logits processor that only timestamps each generation step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def hf_figures(hf_dir: str, sz: Sizes, vocab: int, device: torch.device) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
    rng = random.Random(1)

    def generate(ids: list[list[int]], new: int, proc: _StepTimes | None = None) -> None:
        x = torch.tensor(ids, device=device)
        with torch.inference_mode():
            model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([proc] if proc else []),
            )
        sync(device)

    out: dict[str, float] = {}
    generate([random_prompt(rng, 16, vocab)], 2)  # warm-up
    for length in sz.prefill_lens:
        times = []
        for _ in range(max(1, sz.repeat - 1)):  # HF is slow: one fewer repeat
            ids = [random_prompt(rng, length, vocab)]
            t0 = time.perf_counter()
            generate(ids, 1)
            times.append(time.perf_counter() - t0)
        out[f"prefill_{length}"] = length / min(times)
    for batch in sz.decode_batches:
        proc = _StepTimes()
        generate(
            [random_prompt(rng, sz.decode_ctx, vocab) for _ in range(batch)],
            sz.decode_steps + 1,
            proc,
        )
        out[f"decode_{batch}"] = statistics.median(
            b - a for a, b in zip(proc.times, proc.times[1:])
        )
    t0 = time.perf_counter()
    for _ in range(sz.hf_seq):
        generate([random_prompt(rng, sz.tput_in, vocab)], sz.tput_out)
    out["throughput"] = sz.hf_seq * sz.tput_out / (time.perf_counter() - t0)
    return out


# ---- the run


@dataclass(kw_only=True)
class Figures:
    """One run's figures: the limits measured before and after, servelab's and HF's."""

    sizes: Sizes
    bandwidth: float  # GB/s, at the start
    bandwidth_after: float  # GB/s, at the end
    gemm: float  # FLOP/s
    weight_bytes: float  # what a decode step reads
    per_token: float  # the layers' FLOPs a token
    ceilings: dict[int, float]  # prefill tok/s at the GEMM rate, by prompt length
    ours: dict[str, float]
    hf: dict[str, float]

    @property
    def floor(self) -> float:
        """The decode floor in seconds: the weights a step reads over the read bandwidth."""
        return self.weight_bytes / (self.bandwidth * 1e9)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the script runs")
    ap.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> Figures:
    torch.set_num_threads(args.threads)
    sz = QUICK if args.quick else Sizes()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    console.print(f"[bold]engine_speed[/bold]: {args.model} on {device}, {args.threads} threads")
    console.print("measuring the machine's limits...")
    bandwidth = read_bandwidth(device, 5)
    loaded = load_model(args.model, device=str(device))
    c = loaded.config
    spec = from_model_config(c, args.model)
    gemm = gemm_rate(spec, 512, device, 5)
    weight_bytes = decode_bytes(spec, loaded.model)
    per_token = spec.flops_per_token  # the LM head runs only where a token is sampled
    console.print(
        f"read {bandwidth:.1f} GB/s -> decode floor {weight_bytes / (bandwidth * 1e9) * 1e3:.1f} "
        f"ms ({weight_bytes / 1e6:.0f} MB of weights); GEMM {gemm / 1e9:.1f} GFLOP/s -> prefill "
        f"ceiling {gemm / per_token:,.0f} tok/s ({per_token / 1e6:.0f} MFLOP/token before "
        "attention)"
    )
    console.print("servelab...")
    config = EngineConfig(max_num_batched_tokens=max(2048, *sz.prefill_lens))
    engine = LLMEngine(
        TorchModelRunner(loaded, device=str(device), num_threads=args.threads),
        config,
        loaded.tokenizer,
    )
    ours = engine_figures(engine, sz, c.vocab_size)
    hf: dict[str, float] = {}
    if not args.no_hf:
        path = resolve_model(args.model)
        if is_gguf(path):
            path = cached_hf_dir(path)
        del engine, loaded
        gc.collect()
        console.print("HF transformers...")
        hf = hf_figures(str(path), sz, c.vocab_size, device)
    return Figures(
        sizes=sz,
        bandwidth=bandwidth,
        # Other load changes the machine under the run: measured again, to say so.
        bandwidth_after=read_bandwidth(device, 5),
        gemm=gemm,
        weight_bytes=weight_bytes,
        per_token=per_token,
        ceilings={n: gemm * n / prefill_flops(spec, n) for n in sz.prefill_lens},
        ours=ours,
        hf=hf,
    )


def show(f: Figures) -> None:
    console.print(_table(f.ours, f.hf, f.sizes, f.floor, f.ceilings))
    drift = abs(f.bandwidth_after - f.bandwidth) / f.bandwidth
    note = (
        "  [bold red]the machine changed during the run: rerun on a quiet one[/]"
        if drift > 0.2
        else ""
    )
    console.print(
        f"read bandwidth {f.bandwidth:.1f} GB/s at the start, {f.bandwidth_after:.1f} GB/s at "
        f"the end{note}"
    )


def main(argv: list[str] | None = None) -> None:
    keep_step_buffers()  # the engine core's heap policy: measure what the server runs
    show(run(parse_args(argv)))


def _table(
    ours: dict[str, float],
    hf: dict[str, float],
    sz: Sizes,
    floor: float,
    ceilings: dict[int, float],
) -> Table:
    t = Table(title="servelab engine speed (provisional: ratios matter, not absolutes)")
    for col in ("figure", "servelab", "HF", "servelab / HF", "vs machine limit", "target", "met"):
        t.add_column(col, justify="left" if col in ("figure", "target") else "right")

    def hf_cell(key: str, fmt: str) -> str:
        return format(hf[key], fmt) if key in hf else "-"

    for length in sz.prefill_lens:
        k = f"prefill_{length}"
        frac = ours[k] / ceilings[length]
        t.add_row(
            f"prefill {length} tokens (tok/s)",
            f"{ours[k]:,.0f}",
            hf_cell(k, ",.0f"),
            f"{ours[k] / hf[k]:.2f}x" if k in hf else "-",
            f"{frac:.0%} of matmul rate",
            ">= 80%",
            "yes" if frac >= 0.8 else "no",
        )
    for batch in sz.decode_batches:
        k = f"decode_{batch}"
        ratio = ours[k] / floor
        t.add_row(
            f"decode step, batch {batch} (ms)",
            f"{ours[k] * 1e3:.1f}",
            f"{hf[k] * 1e3:.1f}" if k in hf else "-",
            f"{hf[k] / ours[k]:.2f}x faster" if k in hf else "-",
            f"{ratio:.2f}x floor",
            "<= 1.5x floor" if batch == 1 else "",
            ("yes" if ratio <= 1.5 else "no") if batch == 1 else "",
        )
    k = "throughput"
    gain = ours[k] / hf[k] if k in hf else None
    t.add_row(
        f"output tok/s, {sz.tput_requests} x {sz.tput_in} in / {sz.tput_out} out",
        f"{ours[k]:,.1f}",
        hf_cell(k, ",.1f") + (" (sequential)" if k in hf else ""),
        f"{gain:.2f}x" if gain else "-",
        "",
        ">= 4x HF sequential",
        ("yes" if gain >= 4 else "no") if gain else "",
    )
    return t


if __name__ == "__main__":
    main()
