"""How fast is the servelab engine, against HF transformers and against the machine's limits?

One run, same fp32 weights (the GGUF's dequantised HF directory), same thread count:

- the machine's limits, measured first: streaming read bandwidth (a torch sum over 512 MB)
  -> the decode floor (weight bytes / bandwidth, every step reads all weights); fp32 GEMM
  FLOP/s (the faster of ``F.linear`` and, on CPU, oneDNN's linear on weights packed ahead
  of time, at prefill shapes; ``benchmarks.engine.kernel_speed --gemm`` compares every backend) -> the
  prefill ceiling: 2 FLOP per non-embedding
  weight per token (~212 MFLOP for SmolLM2-135M) plus causal attention's score and value
  products (4 * heads * head_dim per visible key per layer: +8% at 512 tokens, +33% at
  2048), all at the measured GEMM rate;
- prefill tokens/s at 512- and 2048-token prompts (one request, one chunk);
- decode step time at batch 1, 8 and 32 (256-token prompts; steps that only decode);
- output tokens/s for 64 requests of 256 in / 64 out, all submitted at once, against HF
  ``generate`` one request after another (HF runs ``--hf-seq`` of them; its rate per request
  does not depend on how many run in sequence).

Targets (printed with each figure): decode at batch 1 <= 1.5x the floor; prefill >= 80% of
the matmul rate; batched output throughput >= 4x HF sequential.

Figures are provisional whenever other work shares the machine: read the ratios, which are
measured side by side in one run, not the absolute numbers.

Usage: python -m benchmarks.engine.engine_speed [--model smollm2-135m] [--threads N] [--device cpu]
       [--quick]   (small sizes, to check that the script runs)
"""

from __future__ import annotations

import servelab  # noqa: F401  (first: it sets OMP_WAIT_POLICY before torch loads OpenMP)

# isort: split
import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from servelab.engine.config import EngineConfig
from servelab.engine.engine import LLMEngine
from servelab.engine.sampling_params import SamplingParams
from servelab.model.config import ModelConfig
from servelab.model.llama import LlamaForCausalLM
from servelab.model.loader import load_model
from servelab.model.quant import QuantWeight
from servelab.model.registry import is_gguf, resolve_model
from servelab.model.runner import TorchModelRunner
from servelab.model.weight_cache import cached_hf_dir
from servelab.server.heap import keep_step_buffers

console = Console(width=150)


@dataclass
class Sizes:
    prefill_lens: tuple[int, ...] = (512, 2048)
    decode_batches: tuple[int, ...] = (1, 8, 32)
    decode_ctx: int = 256
    decode_steps: int = 16
    tput_requests: int = 64
    tput_in: int = 256
    tput_out: int = 64
    hf_seq: int = 4
    repeat: int = 3


QUICK = Sizes((64, 128), (1, 4), 64, 4, 8, 32, 8, 2, 1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _best(fn: Callable[[], object], repeat: int, device: torch.device) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


# ---- the model's costs ----


def _bytes(w: torch.Tensor | QuantWeight) -> int:
    t = w.blocks if isinstance(w, QuantWeight) else w
    return t.numel() * t.element_size()


def step_bytes(model: LlamaForCausalLM) -> int:
    """What one decode step reads: each layer's weights, the final norm and the LM head."""
    layers = sum(
        _bytes(w)
        for L in model.layers
        for w in (L.qkv_w, L.o_w, L.gate_up_w, L.down_w, L.ln1, L.ln2)
    )
    return layers + _bytes(model.norm) + _bytes(model.lm_head)


def flop_per_token(c: ModelConfig) -> float:
    """FLOPs of the decoder layers' products for one token: 2 per weight."""
    q_out = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    per_layer = q_out + c.num_heads * c.head_dim + 3 * c.intermediate_size
    return 2 * c.num_layers * c.hidden_size * per_layer


def prefill_flops(c: ModelConfig, n: int) -> float:
    """FLOPs of the decoder layers over an n-token prompt: the products (``flop_per_token``
    a token) and causal attention (QK and PV: 4 per head element per visible key)."""
    return n * flop_per_token(c) + 4 * c.num_layers * c.num_heads * c.head_dim * n * (n + 1) / 2


# ---- machine limits ----


def read_bandwidth(device: torch.device, repeat: int) -> float:
    """Streaming read GB/s: a sum over 512 MB of fp32."""
    x = torch.ones(128 * 1024 * 1024, device=device)
    t = _best(lambda: x.sum(), repeat, device)
    return x.numel() * 4 / t / 1e9


def gemm_flops(
    hidden: int, inter: int, q_out: int, rows: int, device: torch.device, repeat: int
) -> float:
    """Best fp32 FLOP/s over one layer's matrices at ``rows`` rows ([out, in] weights)."""
    shapes = [(q_out, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    mats = [torch.randn(o, i, device=device) for o, i in shapes]
    xs = {i: torch.randn(rows, i, device=device) for _, i in shapes}
    flops = sum(2 * rows * o * i for o, i in shapes)
    t = _best(lambda: [F.linear(xs[m.shape[1]], m) for m in mats], repeat, device)
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        dnn = torch.ops.mkldnn
        packed = [(xs[m.shape[1]], dnn._reorder_linear_weight(m, rows)) for m in mats]

        def onednn() -> None:
            for x, p in packed:
                dnn._linear_pointwise(x, p, None, "none", [], "")

        t = min(t, _best(onednn, repeat, device))
    return flops / t


# ---- servelab ----


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1000, vocab) for _ in range(n)]  # random ids: no prefix-cache hits


def _run(engine: LLMEngine) -> list:
    records = []
    while engine.has_unfinished():
        rec = engine.step().record
        if rec is not None:
            records.append(rec)
    return records


def servelab_figures(
    engine: LLMEngine, sz: Sizes, vocab: int, gemm: Callable[[], float] | None = None
) -> dict[str, float]:
    """The engine's figures. With ``gemm`` (a GEMM rate, measured when called), each prefill
    repeat is followed by one, and ``gemm_{length}`` is the highest of them: a reference
    taken at the same moments as the prefill (a shared host's speed drifts over minutes)."""
    rng = random.Random(0)
    out: dict[str, float] = {}
    greedy_one = SamplingParams(max_tokens=1, temperature=0.0)
    n = 0
    for length in sz.prefill_lens:
        times, rates = [], []
        for i in range(sz.repeat + 1):  # first one warms up
            engine.add_request(
                f"p{n}", prompt_token_ids=_prompt(rng, length, vocab), sampling_params=greedy_one
            )
            n += 1
            recs = _run(engine)
            assert len(recs) == 1, "the prompt should run in one chunk"
            times.append(recs[0].duration)
            if gemm is not None and i:
                rates.append(gemm())
        out[f"prefill_{length}"] = length / min(times[1:])
        if rates:
            out[f"gemm_{length}"] = max(rates)
    for batch in sz.decode_batches:
        sp = SamplingParams(max_tokens=sz.decode_steps + 2, temperature=0.0, ignore_eos=True)
        for _ in range(batch):
            engine.add_request(
                f"d{n}", prompt_token_ids=_prompt(rng, sz.decode_ctx, vocab), sampling_params=sp
            )
            n += 1
        steps = [
            r.duration for r in _run(engine) if r.prefill_tokens == 0 and r.decode_seqs == batch
        ]
        out[f"decode_{batch}"] = statistics.median(steps)
    if not sz.tput_requests:
        return out
    sp = SamplingParams(max_tokens=sz.tput_out, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for _ in range(sz.tput_requests):
        engine.add_request(
            f"t{n}", prompt_token_ids=_prompt(rng, sz.tput_in, vocab), sampling_params=sp
        )
        n += 1
    _run(engine)
    out["throughput"] = sz.tput_requests * sz.tput_out / (time.perf_counter() - t0)
    return out


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
        _sync(device)

    out: dict[str, float] = {}
    generate([_prompt(rng, 16, vocab)], 2)  # warm-up
    for length in sz.prefill_lens:
        times = []
        for _ in range(max(1, sz.repeat - 1)):  # HF is slow: one fewer repeat
            ids = [_prompt(rng, length, vocab)]
            t0 = time.perf_counter()
            generate(ids, 1)
            times.append(time.perf_counter() - t0)
        out[f"prefill_{length}"] = length / min(times)
    for batch in sz.decode_batches:
        proc = _StepTimes()
        generate(
            [_prompt(rng, sz.decode_ctx, vocab) for _ in range(batch)], sz.decode_steps + 1, proc
        )
        out[f"decode_{batch}"] = statistics.median(
            b - a for a, b in zip(proc.times, proc.times[1:])
        )
    t0 = time.perf_counter()
    for _ in range(sz.hf_seq):
        generate([_prompt(rng, sz.tput_in, vocab)], sz.tput_out)
    out["throughput"] = sz.hf_seq * sz.tput_out / (time.perf_counter() - t0)
    return out


# ---- report ----


def main() -> None:
    keep_step_buffers()  # the engine core's heap policy: measure what the server runs
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the script runs")
    ap.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sz = QUICK if args.quick else Sizes()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    console.print(f"[bold]engine_speed[/bold]: {args.model} on {device}, {args.threads} threads")
    console.print("measuring the machine's limits...")
    bandwidth = read_bandwidth(device, 5)
    loaded = load_model(args.model, device=str(device))
    c = loaded.config
    weight_bytes = step_bytes(loaded.model)
    # The LM head runs only where a token is sampled.
    per_token = flop_per_token(c)
    q_out = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    flops = gemm_flops(c.hidden_size, c.intermediate_size, q_out, 512, device, 5)
    floor = weight_bytes / (bandwidth * 1e9)
    ceiling = flops / per_token
    ceilings = {n: flops * n / prefill_flops(c, n) for n in sz.prefill_lens}
    console.print(
        f"read {bandwidth:.1f} GB/s -> decode floor {floor * 1e3:.1f} ms "
        f"({weight_bytes / 1e6:.0f} MB of weights); GEMM {flops / 1e9:.1f} GFLOP/s -> prefill "
        f"ceiling {ceiling:,.0f} tok/s ({per_token / 1e6:.0f} MFLOP/token before attention)"
    )
    console.print("servelab...")
    config = EngineConfig(max_num_batched_tokens=max(2048, *sz.prefill_lens))
    engine = LLMEngine(
        TorchModelRunner(loaded, device=str(device), num_threads=args.threads),
        config,
        loaded.tokenizer,
    )
    ours = servelab_figures(engine, sz, c.vocab_size)
    hf: dict[str, float] = {}
    if not args.no_hf:
        path = resolve_model(args.model)
        if is_gguf(path):
            path = cached_hf_dir(path)
        del engine, loaded
        gc.collect()
        console.print("HF transformers...")
        hf = hf_figures(str(path), sz, c.vocab_size, device)
    console.print(_table(ours, hf, sz, floor, ceilings))
    # Other load changes the machine under the run: say so rather than hide it.
    after = read_bandwidth(device, 5)
    drift = abs(after - bandwidth) / bandwidth
    note = (
        "  [bold red]the machine changed during the run: rerun on a quiet one[/]"
        if drift > 0.2
        else ""
    )
    console.print(
        f"read bandwidth {bandwidth:.1f} GB/s at the start, {after:.1f} GB/s at the end{note}"
    )


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
