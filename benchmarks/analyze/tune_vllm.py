"""`servelab tune --verify` on live vLLM (CPU build): predicted through the twin, verified by relaunching vLLM.

    python -m benchmarks.analyze.tune_vllm [--out runs/tune-vllm] [--flags "--no-enable-chunked-prefill"]
        [--workload demo-mixed] [--load "--concurrency 4 --requests 32"] [--repeats 2] [--seeds 5]
        [--objective FIGURE[@CLASS]] [--tolerance 0.15] [--reuse] [--vllm-python PATH] [--weights DIR]

1. vLLM serves SmolLM2-135M (weights from ``servelab export-hf``) on CPU 1, launched from
   the command template of ``benchmarks.sim.twin_vllm`` with ``--flags`` (default: chunked
   prefill off), warmed with four requests; the benchmark client runs on CPU 0. The run
   (``--workload`` at length scale 0.5, ``--load``; by default the demo's mixed traffic,
   short chats decoding while 700-800-token RAG prompts arrive) records its launch in its
   manifest (``workflows.matrix.record_server``: the template, the command, the flags).
2. ``servelab tune`` replays the run on the twin calibrated on it (the self-check), predicts
   the candidates its findings call for in vLLM's own flags, decides, and with ``--verify``
   relaunches vLLM from ``--server-template`` twice -- the run's flags, and those plus the
   chosen setting's -- reruns the same planned requests ``--repeats`` times each, in
   alternating order, and reports predicted against measured.
3. Prints the tune view (self-check, decision, verification) and writes ``tune.json`` and
   ``tune.html`` beside the runs.

``--reuse`` tunes the run already in ``--out`` again (its bench is skipped), e.g. with
another ``--objective``. About 6 minutes on a quiet machine: three vLLM starts (one, then
two at once), a warm-up, five benchmark runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import time
from pathlib import Path

import yaml
from rich.console import Console

from benchmarks.sim.twin_check import Case, bench
from benchmarks.sim.twin_vllm import VLLM_PYTHON, exported_weights, vllm_peer
from servelab.bench.servers.template import TemplateServer
from servelab.report.tuning_view import render_tuning, write_tuning_report
from servelab.workflows.demo import mixed_workload
from servelab.workflows.matrix import record_server
from servelab.workflows.tuning_loop import TuneSpec, run_tune

# The demo's mixed traffic (short chats decoding while 700-800-token RAG prompts arrive) at
# twice its lengths, since the bench runs at length scale 0.5.
DEMO_MIXED = "demo-mixed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/tune-vllm")
    ap.add_argument("--flags", default="--no-enable-chunked-prefill", help="vLLM's, as run")
    ap.add_argument("--workload", default=DEMO_MIXED, help=f"a preset, a file, or {DEMO_MIXED}")
    ap.add_argument("--load", default="--concurrency 4 --requests 32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--objective", default=None)
    ap.add_argument("--tolerance", type=float, default=0.15, help="the self-check's")
    ap.add_argument("--vllm-python", default=VLLM_PYTHON)
    ap.add_argument("--weights", default=None, help="HF weights dir (default: exported)")
    ap.add_argument("--health-timeout", type=float, default=900.0)
    ap.add_argument("--reuse", action="store_true", help="tune the run already in --out")
    args = ap.parse_args()
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    t_start = time.perf_counter()
    weights = exported_weights(
        Path(args.weights) if args.weights else out / "weights", logs / "export.log", timings
    )
    # The template's dev mode serves POST /reset_prefix_cache, which the bench calls before
    # each run: the verification's later repeats must not find the earlier ones' prompts.
    peer = vllm_peer(args.vllm_python, weights)
    template = peer.template
    run_dir = out / "run"
    workload = args.workload
    if workload == DEMO_MIXED:
        workload = str(out / f"{DEMO_MIXED}.yaml")
        Path(workload).write_text(yaml.safe_dump(mixed_workload(2.0), sort_keys=False))
    if not args.reuse:
        t0 = time.perf_counter()
        server = TemplateServer(template, logs / "vllm-as-run.log", str(weights), args.flags)
        try:
            asyncio.run(server.wait_healthy(timeout=args.health_timeout))
            timings["start_vllm_s"] = time.perf_counter() - t0
            warm = Case("warm-up", "chat", "--concurrency 4 --requests 4", args.flags)
            timings["warm_up_s"] = bench(peer, warm, server.url, out / "warmup", logs)
            case = Case("run", workload, args.load, args.flags)
            timings["bench_s"] = bench(peer, case, server.url, run_dir, logs)
            record_server(run_dir, server)
        finally:
            server.stop()
    # The client side (the tune process, its verification's benchmark) on CPU 0; the
    # template pins vLLM to CPU 1.
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    spec = TuneSpec(
        run_dir,
        objective=args.objective,
        tolerance=args.tolerance,
        seeds=args.seeds,
        jobs=1,
        verify=True,
        repeats=args.repeats,
        out=out / "verify",
        server_template=template,
        server_model=str(weights),
        health_timeout=args.health_timeout,
    )
    print(f"$ servelab tune {run_dir} --verify --repeats {args.repeats} --seeds {args.seeds} "
          f"--server-template {shlex.quote(template)} --server-model {weights}"
          + (f" --objective {args.objective}" if args.objective else "")
          + f" --tolerance {args.tolerance}")  # fmt: skip
    t0 = time.perf_counter()
    console = Console(width=140)
    tuning = run_tune(spec, console)
    timings["tune_s"] = time.perf_counter() - t0
    render_tuning(tuning, console)
    write_tuning_report(tuning, out / "tune.html")
    timings["total_s"] = time.perf_counter() - t_start
    (out / "tune.json").write_text(
        json.dumps({"tuning": tuning.to_dict(), "timings_s": timings}, indent=1, default=str)
    )
    print("timings (s):", json.dumps({k: round(v, 1) for k, v in timings.items()}))


if __name__ == "__main__":
    main()
