"""What several benchmarks share.

- ``ROOT``, the repository root;
- timing: ``best_time``, the best of some repeats after a warm-up (``sync`` on CUDA);
- the machine's limits, measured: ``read_bandwidth`` (streaming read GB/s) and
  ``gemm_rate`` (fp32 or bf16 FLOP/s over one layer's products, ``layer_shapes``);
- the model's costs, counted by the simulator's ``ModelSpec``: ``prefill_flops``,
  ``decode_flops`` and ``decode_bytes`` (the weights a decode step streams, in the datatypes
  the loaded model holds them in);
- the engine's figures on random prompts (``engine_figures``, sized by ``Sizes``);
- ``serve``: `servelab serve` started from this interpreter, pinned to a CPU, once healthy;
- ``fetch_timelines``: a servelab server's (or the test server's) request timelines.

The peers' servers and benchmark clients are in ``benchmarks.peers``. torch is imported
only where the machine is measured or a loaded model read, so that the client and server
benchmarks, which need neither, do not load it.
"""

from __future__ import annotations

import servelab.model  # noqa: F401  (first: it sets OMP_WAIT_POLICY before torch loads OpenMP)

# isort: split
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from servelab.engine.engine import LLMEngine
from servelab.engine.sampling_params import SamplingParams
from servelab.sim.costs.model_shapes import ModelSpec
from servelab.sim.costs.work import StepWork, decode_work

if TYPE_CHECKING:
    import torch

    from servelab.model.llama import LlamaForCausalLM
    from servelab.model.quant import QuantWeight

ROOT = Path(__file__).resolve().parents[1]
SERVE_TIMEOUT_S = 900.0  # loading and dequantising a model on 2 busy cores takes a while


# ---- timing and the machine's limits


def sync(device: torch.device | None) -> None:
    """Wait for a CUDA ``device``'s queued kernels (nothing to wait for elsewhere)."""
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def best_time(fn: Callable[[], object], repeat: int, device: torch.device | None = None) -> float:
    """The fastest of ``repeat`` calls of ``fn`` in seconds, after one warm-up call (page-in,
    thread pools up); on a CUDA ``device`` each call is timed to its last kernel."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth(device: torch.device, repeat: int) -> float:
    """Streaming read GB/s: a sum over 512 MB of fp32."""
    import torch

    x = torch.ones(128 * 1024 * 1024, device=device)
    t = best_time(lambda: x.sum(), repeat, device)
    return x.numel() * 4 / t / 1e9


def layer_shapes(spec: ModelSpec) -> list[tuple[str, int, int]]:
    """(name, out features, in features) of one decoder layer's products as the model runs
    them: q/k/v fused, the attention output, gate/up fused, down."""
    h = spec.hidden
    return [
        ("qkv", spec.q_dim + 2 * spec.kv_dim, h),
        ("o_proj", h, spec.q_dim),
        ("gate_up", 2 * spec.intermediate, h),
        ("down", h, spec.intermediate),
    ]


def gemm_rate(
    spec: ModelSpec, rows: int, device: torch.device, repeat: int, dtype: str = "float32"
) -> float:
    """Best FLOP/s (fp32, or ``dtype="bfloat16"``) over one layer's products
    (``layer_shapes``) at ``rows`` rows: the faster of ``F.linear`` and, on CPU, oneDNN's
    linear on weights packed ahead of time (``benchmarks.engine.kernel_speed --gemm``
    compares every backend)."""
    import torch
    import torch.nn.functional as F

    dt = getattr(torch, dtype)
    shapes = [(o, i) for _, o, i in layer_shapes(spec)]
    mats = [torch.randn(o, i, device=device, dtype=dt) for o, i in shapes]
    xs = {i: torch.randn(rows, i, device=device, dtype=dt) for _, i in shapes}
    flops = sum(2 * rows * o * i for o, i in shapes)
    t = best_time(lambda: [F.linear(xs[m.shape[1]], m) for m in mats], repeat, device)
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        dnn = torch.ops.mkldnn
        packed = [(xs[m.shape[1]], dnn._reorder_linear_weight(m, rows)) for m in mats]

        def onednn() -> None:
            for x, p in packed:
                dnn._linear_pointwise(x, p, None, "none", [], "")

        t = min(t, best_time(onednn, repeat, device))
    return flops / t


# ---- the model's costs (the simulator's count)


def prefill_flops(spec: ModelSpec, n: int) -> float:
    """FLOPs of an n-token prompt in one chunk: the layers for every token, causal attention,
    and the LM head at the one position that samples."""
    work = StepWork()
    work.add(n, 0, logits=1)
    return spec.flops(work)


def decode_flops(spec: ModelSpec, batch: int, ctx: int) -> float:
    """FLOPs of a decode step of ``batch`` sequences with ``ctx`` cached tokens each."""
    return spec.flops(decode_work(batch, batch * ctx))


def _bytes_per_weight(w: torch.Tensor | QuantWeight) -> float:
    from servelab.model.quant import QuantWeight

    if isinstance(w, QuantWeight):
        return w.blocks.numel() * w.blocks.element_size() / (w.n * w.k)
    return w.element_size()


def decode_bytes(spec: ModelSpec, model: LlamaForCausalLM) -> float:
    """What one decode step reads of ``model``'s weights (``ModelSpec.streamed_bytes``) in
    the datatypes it holds them in: its layers' matrices, its LM head, its norms."""
    matrices = {
        _bytes_per_weight(w)
        for layer in model.layers
        for w in (layer.qkv_w, layer.o_w, layer.gate_up_w, layer.down_w)
    }
    if len(matrices) != 1:
        raise ValueError(f"the layers' matrices mix datatypes ({sorted(matrices)} bytes a weight)")
    head, norm = _bytes_per_weight(model.lm_head), _bytes_per_weight(model.norm)
    return spec.streamed_bytes(matrices.pop(), head, norm)


# ---- the engine's figures


@dataclass(kw_only=True)
class Sizes:
    """What ``engine_figures`` measures: prefill at each length, decode at each batch (steps
    that only decode, ``decode_ctx``-token prompts), and ``tput_requests`` requests of
    ``tput_in`` in / ``tput_out`` out submitted at once (none: skipped)."""

    prefill_lens: tuple[int, ...] = (512, 2048)
    decode_batches: tuple[int, ...] = (1, 8, 32)
    decode_ctx: int = 256
    decode_steps: int = 16
    tput_requests: int = 64
    tput_in: int = 256
    tput_out: int = 64
    hf_seq: int = 4  # HF transformers' sequential requests (benchmarks.engine.engine_speed)
    repeat: int = 3


def random_prompt(rng: random.Random, n: int, vocab: int, first: int = 1000) -> list[int]:
    """``n`` random ids in [first, vocab): no prefix-cache hits, no special tokens."""
    return [rng.randrange(first, vocab) for _ in range(n)]


def _drain(engine: LLMEngine) -> list:
    records = []
    while engine.has_unfinished():
        rec = engine.step().record
        if rec is not None:
            records.append(rec)
    return records


def engine_figures(
    engine: LLMEngine, sz: Sizes, vocab: int, gemm: Callable[[], float] | None = None
) -> dict[str, float]:
    """``prefill_{n}`` (tok/s, one chunk), ``decode_{b}`` (median step seconds) and, with
    ``tput_requests``, ``throughput`` (output tok/s). With ``gemm`` (a GEMM rate, measured
    when called), each prefill repeat is followed by one, and ``gemm_{n}`` is the highest of
    them: a reference taken at the same moments as the prefill (a shared host's speed drifts
    over minutes)."""
    rng = random.Random(0)
    out: dict[str, float] = {}
    greedy_one = SamplingParams(max_tokens=1, temperature=0.0)
    n = 0
    for length in sz.prefill_lens:
        times, rates = [], []
        for i in range(sz.repeat + 1):  # first one warms up
            engine.add_request(
                f"p{n}",
                prompt_token_ids=random_prompt(rng, length, vocab),
                sampling_params=greedy_one,
            )
            n += 1
            recs = _drain(engine)
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
                f"d{n}",
                prompt_token_ids=random_prompt(rng, sz.decode_ctx, vocab),
                sampling_params=sp,
            )
            n += 1
        steps = [
            r.duration for r in _drain(engine) if r.prefill_tokens == 0 and r.decode_seqs == batch
        ]
        out[f"decode_{batch}"] = statistics.median(steps)
    if not sz.tput_requests:
        return out
    sp = SamplingParams(max_tokens=sz.tput_out, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for _ in range(sz.tput_requests):
        engine.add_request(
            f"t{n}", prompt_token_ids=random_prompt(rng, sz.tput_in, vocab), sampling_params=sp
        )
        n += 1
    _drain(engine)
    out["throughput"] = sz.tput_requests * sz.tput_out / (time.perf_counter() - t0)
    return out


# ---- servers


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def serve(
    flags: list[str], port: int, cpu: int | None, quiet: bool = False
) -> subprocess.Popen[bytes]:
    """``servelab serve --port PORT FLAGS`` from this interpreter (children inherit its
    PYTHONPATH), pinned to ``cpu`` with taskset (None: unpinned), returned once ``/health``
    answers 200. ``quiet`` keeps its stderr for the message when it exits early. SystemExit
    when it exits first or is not up in ``SERVE_TIMEOUT_S``."""
    cmd = [sys.executable, "-m", "servelab.cli", "serve", "--port", str(port), *flags]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    print(f"starting: {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE if quiet else None)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise SystemExit(f"servelab serve exited with {proc.returncode}:\n{err}")
        if _healthy(url):
            return proc
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"servelab serve did not become ready in {SERVE_TIMEOUT_S / 60:.0f} minutes")


async def fetch_timelines(url: str, ids: list[str]) -> dict[str, dict]:
    """The server's timelines of the requests ``ids``, by request id (100 ids a query)."""
    out: dict[str, dict] = {}
    async with aiohttp.ClientSession() as s:
        for i in range(0, len(ids), 100):
            async with s.get(
                f"{url}/v1/timelines", params={"ids": ",".join(ids[i : i + 100])}
            ) as r:
                for tl in (await r.json())["timelines"]:
                    out[tl["request_id"]] = tl
    return out
