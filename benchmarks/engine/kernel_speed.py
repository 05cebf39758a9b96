"""Which matmul kernel is fastest for the linear layers of the default model, per row count?

Decode is bandwidth-bound: every step streams all weights from memory, so the kernels
are timed the way the model uses them -- one pass over all 30 layers' matrices (fused
q/k/v and gate/up, 425 MB of fp32, far larger than any cache) with the same input rows,
plus the LM head. Side by side in one run:

- ``torch``: ``F.linear(x, W)`` (MKL on CPU);
- ``np_xwt``: numpy ``x @ W.T`` on zero-copy views (OpenBLAS);
- ``np_wxt``: numpy ``(W @ x.T).T`` (OpenBLAS, the other operand order);
- ``servelab``: servelab's own AVX2 kernel (``servelab.model.cpu_kernels``), up to its
  ``MAX_ROWS``.

Prints ms per pass, effective GB/s (weight bytes / time), and each variant's ratio to
torch. ``servelab.model.linear`` routes decode-sized row counts to servelab's kernel (or,
where it is not built, to numpy up to 16 rows) and larger ones to torch; the table is
where those thresholds come from. Figures are provisional whenever
other work shares the machine: compare ratios within one run, never absolute numbers.

With ``--model NAME`` it then measures the model itself through ``TorchModelRunner``,
each figure next to its limit measured in the same run: a decode step at batch 1 and 8
against the bandwidth floor (a torch sum over the same weight bytes), and a 512-token
prefill against the GEMM throughput of the same shapes; with servelab's routing, with its
CPU kernels switched off (numpy/OpenBLAS for decode, gathered SDPA), and with stock
``F.linear``.

With ``--gemm 1,2`` it measures prefill instead, at each of those thread counts: the fp32
GEMM rate of one layer's four products (summed) at 64-2048 rows for every backend servelab
could route prefill to -- ``torch.mm`` (MKL, what ``F.linear`` runs), numpy/OpenBLAS in
both operand orders writing into torch's memory (``out=`` on ``.numpy()`` views), oneDNN's
linear on the plain weight (``onednn``, what servelab routes to where its AVX-512 kernels
are not built) and on a weight packed ahead of time (``onednn_packed``), and servelab's
kernel on the weight interleaved by 16 rows (``servelab_f32x16``, what it routes to where
they are), and in bf16 oneDNN's linear (``onednn_bf16``) beside servelab's bf16 kernel
(``servelab_bf16x16``, ``--quantization bf16``) -- in alternating rounds, best kept; then the model's prefill at 256-2048 tokens
as served and with stock ``F.linear`` on the plain weights, its GFLOP/s (layers plus causal
attention) against the best GEMM rate of the layer's products at the same row count
(oneDNN packed or servelab's), all in the same alternating rounds (target: >= 85%); with
``--quantization`` the model's weights are quantised as served. One thread is timed in CPU
time of the calling thread (every backend then runs inline), so other processes' load on
the core does not count; more threads are timed by the wall clock and read true only on a
quiet machine.

Usage: python -m benchmarks.engine.kernel_speed [--rows 1,4,16,64,256] [--threads N] [--repeat 5]
                                         [--model smollm2-135m] [--skip-kernels]
       python -m benchmarks.engine.kernel_speed --gemm 1,2 [--repeat 5] [--model smollm2-135m]
                                    [--quantization none|q8_0|q4_1]
"""

from __future__ import annotations

import servelab.model  # noqa: F401  (first: it sets OMP_WAIT_POLICY before torch loads OpenMP)

# isort: split
import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from threadpoolctl import threadpool_limits

from benchmarks.common import best_time, layer_shapes, prefill_flops
from servelab.model import cpu_kernels
from servelab.model.quant import QuantWeight, interleave_bf16, interleave_f32
from servelab.server.heap import keep_step_buffers
from servelab.sim.costs.model_shapes import PRESETS, ModelSpec, from_model_config

DEFAULT = PRESETS["smollm2-135m"]  # the shapes the kernels are timed at


def variants(mats: list[torch.Tensor], rows: int) -> dict[str, Callable[[], object]]:
    xs = {m.shape[1]: torch.randn(rows, m.shape[1]) for m in mats}
    xs_np = {k: v.numpy() for k, v in xs.items()}
    w_np = [m.numpy() for m in mats]
    out = {
        "torch": lambda: [F.linear(xs[m.shape[1]], m) for m in mats],
        "np_xwt": lambda: [xs_np[w.shape[1]] @ w.T for w in w_np],
        "np_wxt": lambda: [np.ascontiguousarray((w @ xs_np[w.shape[1]].T).T) for w in w_np],
    }
    if rows <= cpu_kernels.MAX_ROWS and cpu_kernels.available():
        out["servelab"] = lambda: [cpu_kernels.linear(xs[m.shape[1]], m) for m in mats]
    return out


def _plan(step: int, seqs: list[tuple[str, list[int], int, list[int]]]):
    """A plan of greedy sequences (request id, token ids, start position, block table),
    each sampling one token."""
    from servelab.engine.batch_plan import BatchPlan, ScheduledSeq
    from servelab.engine.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    return BatchPlan(
        step_id=step,
        seqs=[
            ScheduledSeq(
                request_id=rid,
                token_ids=ids,
                start_pos=start,
                block_table=table,
                sample=True,
                sampling=greedy,
            )
            for rid, ids, start, table in seqs
        ],
    )


def _decode_plan(step: int, batch: int, ctx: int, token: int):
    blocks = -(-(ctx + 64) // 16)
    seqs = [
        (f"r{i}", [token], ctx + step % 64, list(range(i * blocks, (i + 1) * blocks)))
        for i in range(batch)
    ]
    return _plan(step, seqs)


def bench_model(name: str, threads: int, repeat: int) -> None:
    """Decode and prefill of the real model, against the floors measured alongside."""
    from servelab.model import linear as lin
    from servelab.model.torch_runner import TorchModelRunner

    # As served, and in the plain layout for the modes with servelab's kernels off.
    runners = {
        plain: TorchModelRunner(_load(name, plain), device="cpu", num_threads=threads, seed=0)
        for plain in (False, True)
    }
    ctx, batch_max, prompt_len = 128, 8, 512
    blocks = -(-(ctx + 64) // 16)
    for runner in runners.values():
        runner.allocate_kv(max(batch_max * blocks, -(-prompt_len // 16)) + 1, 16)
    params = [p for p in runners[True].model.parameters()]
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    floor = best_time(lambda: [p.sum() for p in params], repeat)
    vocab = runners[True].config.vocab_size
    layer_mats = [p for p in params if p.dim() == 2 and p.shape[0] != vocab]
    x512 = {m.shape[1]: torch.randn(prompt_len, m.shape[1]).numpy() for m in layer_mats}
    gemm = best_time(
        lambda: [x512[m.shape[1]] @ m.numpy().T for m in layer_mats], max(2, repeat // 2)
    )
    gemm_flops = sum(2 * prompt_len * m.numel() for m in layer_mats)
    print(
        f"\n{name}: {weight_bytes / 1e6:.0f} MB of weights; bandwidth floor (torch sum) "
        f"{floor * 1e3:.1f} ms = {weight_bytes / floor / 1e9:.1f} GB/s; "
        f"GEMM of the layer shapes at {prompt_len} rows: {gemm_flops / gemm / 1e9:.0f} GFLOP/s"
    )
    prompt = list(range(100, 100 + prompt_len))
    table = list(range(-(-prompt_len // 16)))
    model_flops_per_token = from_model_config(runners[True].config, name).flops_per_token
    modes = {
        "servelab routing": (True, True),
        "kernels off     ": (True, False),
        "stock F.linear  ": (False, False),
    }
    for label, (routed, kernels) in modes.items():
        lin.use_numpy_on_cpu = routed
        cpu_kernels.enabled = kernels
        runner = runners[not kernels]
        runner.paged_kernel = kernels and runner.config.head_dim % 16 == 0
        for batch in (1, batch_max):
            step = iter(range(10**6))
            t = best_time(
                lambda b=batch, s=step, r=runner: r.execute(_decode_plan(next(s), b, ctx, 42)),
                repeat,
            )
            print(f"{label} decode batch {batch}: {t * 1e3:6.1f} ms/step = {t / floor:.2f}x floor")
        pre = _plan(0, [("p", prompt, 0, table)])
        t = best_time(lambda p=pre, r=runner: r.execute(p), max(2, repeat // 2))
        achieved = model_flops_per_token * prompt_len / t / 1e9
        print(
            f"{label} prefill {prompt_len}: {t * 1e3:6.0f} ms = {prompt_len / t:.0f} tok/s, "
            f"{achieved:.0f} GFLOP/s = {achieved / (gemm_flops / gemm / 1e9):.0%} of GEMM"
        )
    lin.use_numpy_on_cpu = True
    cpu_kernels.enabled = True


GEMM_ROWS = (64, 256, 1024, 2048)
PREFILL_LENS = (256, 1024, 2048)


def _clock(threads: int) -> Callable[[], float]:
    return time.thread_time if threads == 1 else time.perf_counter


def _interleaved(fns: dict[str, Callable[[], object]], rounds: int, clock) -> dict[str, float]:
    """Best time of each function over ``rounds`` rounds that run them in turn."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = clock()
            fn()
            best[k] = min(best[k], clock() - t0)
    return best


def gemm_backends(w: torch.Tensor, rows: int) -> dict[str, Callable[[], object]]:
    """``x @ w.T`` at ``rows`` rows through each backend, all writing fp32 torch memory."""
    x = torch.randn(rows, w.shape[1])
    y, yt = torch.empty(rows, w.shape[0]), torch.empty(w.shape[0], rows)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
    fns = {
        "torch_mkl": lambda: torch.mm(x, w.t(), out=y),
        "np_xwt": lambda: np.matmul(x.numpy(), w.numpy().T, out=y.numpy()),
        "np_wxt": lambda: np.matmul(w.numpy(), x.numpy().T, out=yt.numpy()),
        "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        "onednn_packed": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
    }  # fmt: skip
    if cpu_kernels.fp32_interleave_available():
        wi = interleave_f32(w)
        fns["servelab_f32x16"] = lambda: cpu_kernels.qlinear(x, wi, None, y)
    # bf16 (``--quantization bf16``): oneDNN's linear on bf16 inputs and weights, against
    # servelab's bf16 kernel, which takes fp32 inputs and rounds them itself.
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    fns["onednn_bf16"] = lambda: torch.ops.mkldnn._linear_pointwise(xb, wb, None, "none", [], "")
    if cpu_kernels.bf16_dot_available():
        wbi = interleave_bf16(QuantWeight("bf16", wb, w.shape[1]))
        fns["servelab_bf16x16"] = lambda: cpu_kernels.qlinear(x, wbi, None, y)
    return fns


def gemm_rates(spec: ModelSpec, threads: int, rounds: int) -> None:
    """Print each backend's GFLOP/s per row count over one layer's products of ``spec``,
    with its ratio to the best."""
    clock = _clock(threads)
    cpu_kernels.set_num_threads(threads)
    shapes = layer_shapes(spec)
    ws = [torch.randn(o, i) for _, o, i in shapes]
    best_rate = {}
    for rows in GEMM_ROWS:
        total: dict[str, float] = {}
        for w in ws:
            for k, t in _interleaved(gemm_backends(w, rows), rounds, clock).items():
                total[k] = total.get(k, 0.0) + t
        flops = sum(2 * rows * o * i for _, o, i in shapes)
        rates = {k: flops / t / 1e9 for k, t in total.items()}
        best_rate[rows] = max(rates.values())
        cells = "  ".join(f"{k} {r:5.1f} ({r / best_rate[rows]:.2f})" for k, r in rates.items())
        print(f"rows {rows:>4}: {cells}")


def _load(name: str, plain: bool, quantization: str = "none"):
    """The model as served, or (``plain``) with its fp32 weights left in the [out, in]
    layout that torch's and the BLAS backends take (the CPU kernels off while it loads)."""
    from servelab.model.loader import load_model

    cpu_kernels.enabled = not plain
    try:
        return load_model(name, device="cpu", quantization=quantization)
    finally:
        cpu_kernels.enabled = True


def bench_prefill(name: str, quantization: str, threads: int, rounds: int) -> None:
    """The model's prefill, as served and stock, against the best GEMM rate at the same row
    count, each measured in turn with the others (the machine's speed drifts by tens of
    percent over minutes on a shared host, so a rate measured earlier would not do)."""
    from servelab.engine.batch_plan import BatchPlan
    from servelab.model import linear as lin
    from servelab.model.torch_runner import TorchModelRunner

    runners = {}
    for key, plain in (("servelab", False), ("stock F.linear", True)):
        runners[key] = TorchModelRunner(
            _load(name, plain, quantization), device="cpu", num_threads=threads, seed=0
        )
        runners[key].allocate_kv(-(-max(PREFILL_LENS) // 16) + 1, 16)
    spec = from_model_config(runners["servelab"].config, name)
    shapes = layer_shapes(spec)
    clock = _clock(threads)
    for n in PREFILL_LENS:
        plan = _plan(0, [("p", list(range(100, 100 + n)), 0, list(range(-(-n // 16))))])

        def run(key: str, plan: BatchPlan = plan) -> None:
            lin.use_numpy_on_cpu = key == "servelab"
            runners[key].execute(plan)

        fns: dict[str, Callable[[], object]] = {k: lambda k=k: run(k) for k in runners}
        gemms = [gemm_backends(torch.randn(o, i), n) for _, o, i in shapes]
        for b in ("onednn_packed", "servelab_f32x16"):
            if b in gemms[0]:
                fns[b] = lambda b=b, gs=gemms: [g[b]() for g in gs]
        times = _interleaved(fns, rounds, clock)
        layer_flops = sum(2 * n * o * i for _, o, i in shapes)
        gemm = max(layer_flops / times.pop(b) / 1e9 for b in list(times) if b not in runners)
        flops = prefill_flops(spec, n)
        cells = "  ".join(
            f"{k} {n / t:6.0f} tok/s {flops / t / 1e9:5.1f} GFLOP/s = {flops / t / 1e9 / gemm:.0%}"
            for k, t in times.items()
        )
        print(f"prefill {n:>4}: {cells} of best GEMM {gemm:.1f} (target >= 85%)")
    lin.use_numpy_on_cpu = True


def kernel_table(threads: int, repeat: int, rows_list: list[int]) -> None:
    """Every kernel candidate over the default model's layers and its LM head, per row count."""
    shapes = layer_shapes(DEFAULT)
    layer_mats = [torch.randn(o, i) for _ in range(DEFAULT.layers) for _, o, i in shapes]
    head = [torch.randn(DEFAULT.vocab, DEFAULT.hidden)]
    gb_layers = sum(m.numel() for m in layer_mats) * 4 / 1e9
    with threadpool_limits(limits=threads, user_api="blas"):
        print(
            f"threads={threads} (torch and OpenBLAS), best of {repeat}; "
            f"layers = {DEFAULT.layers} x (qkv, o, gate_up, down) = {gb_layers * 1e3:.0f} MB"
        )
        for label, mats, max_rows in (("layers", layer_mats, 1 << 30), ("lm_head", head, 64)):
            print(f"\n{label}: ms per pass (GB/s of weights) and ratio to torch")
            for rows in rows_list:
                if rows > max_rows:
                    continue  # logits are only computed at sampled positions
                gb = sum(m.numel() for m in mats) * 4 / 1e9
                times = {k: best_time(fn, repeat) for k, fn in variants(mats, rows).items()}
                cells = "  ".join(
                    f"{k} {t * 1e3:7.1f} ({gb / t:4.1f}) x{t / times['torch']:.2f}"
                    for k, t in times.items()
                )
                print(f"rows {rows:>4}: {cells}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--model", default=None, help="also measure this model end to end")
    ap.add_argument("--skip-kernels", action="store_true", help="only the --model section")
    ap.add_argument("--gemm", default=None, help="thread counts: prefill GEMM rates, e.g. 1,2")
    ap.add_argument("--quantization", default="none", help="the --gemm model's weights")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    keep_step_buffers()  # the engine core's heap policy: measure what the server runs
    args = parse_args(argv)
    if args.gemm:
        for threads in (int(t) for t in args.gemm.split(",")):
            torch.set_num_threads(threads)
            with threadpool_limits(limits=threads, user_api="blas"):
                print(f"\n{threads} thread(s): GFLOP/s of one layer's products (ratio to best)")
                gemm_rates(DEFAULT, threads, args.repeat)
                if args.model:
                    bench_prefill(args.model, args.quantization, threads, args.repeat)
        return
    torch.set_num_threads(args.threads)
    cpu_kernels.set_num_threads(args.threads)
    if not args.skip_kernels:
        kernel_table(args.threads, args.repeat, [int(r) for r in args.rows.split(",")])
    if args.model:
        bench_model(args.model, args.threads, args.repeat)


if __name__ == "__main__":
    main()
