"""A twin of live vLLM (CPU build): calibrate on one run, predict held-out runs, run them for real.

    python -m benchmarks.sim.twin_vllm [--out runs/twin-vllm] [--cases smoke|all|NAME,...]
        [--vllm-python .venv-peers/vllm/bin/python] [--weights DIR] [--seeds 8]

1. vLLM serves SmolLM2-135M (weights from ``servelab export-hf``) on CPU 1, launched from a
   command template (``bench.template``: its own process group, its log, the command in the
   manifest), one server per set of flags, relaunched between flag sets, its prefix cache
   emptied before every measured run (the runs share sessions; the twin starts cold); the
   client runs on CPU 0 (``taskset``).
2. ``servelab bench`` runs the training case; ``servelab calibrate`` fits the twin to it
   (steps inferred from the client's chunk arrivals, vLLM's settings from its ``/metrics``
   and ``/v1/models``, the stated flags and vLLM's CPU defaults).
3. For each held-out case -- another workload shape, rate or concurrency, or other vLLM
   flags (chunked prefill off, another chunk budget, prefix caching off) -- ``servelab sim
   --calibration --seeds N`` predicts it (the flags translated by ``sim.twin.flag_changes``),
   then ``servelab bench`` runs it for real on a vLLM started with those flags.
4. Prints and writes (``twin.json``) predicted (median and range over the seeds) against
   measured TTFT p50/p90, ITL p50/p99, TPOT p50 and output tok/s: the share within
   ``--tolerance`` (20%) and the share of measured figures inside the predicted range, per
   case and overall; the training case's own replay is listed apart (in-sample). Writes
   ``results.json`` (with each phase's time) beside the twin (``twin.json``) and the runs.

``--reuse`` calibrates and predicts again on the real runs already in ``--out`` (seconds):
for working on the twin against fixed runs. ``--cases smoke`` is the training case and one
held-out case (about 5 minutes on a quiet
machine); ``all`` every case below. The figures are this machine's: a 2-core host shared
with other work drifts by 10-20% over minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import ROOT
from servelab.bench.template import TemplateServer
from servelab.sim.intervals import FIGURES
from servelab.sim.twin import TwinCalibration, flag_changes

SERVELAB = [sys.executable, "-m", "servelab.cli"]
VLLM_PYTHON = str(ROOT / ".venv-peers" / "vllm" / "bin" / "python")  # install.sh's default
SERVED = "smollm2-135m"
# VLLM_SERVER_DEV_MODE=1 opens POST /reset_prefix_cache: every measured run starts from a cold
# prefix cache, as its prediction does (the cases share a server and their prompts).
TEMPLATE = (
    "env -u PYTHONPATH OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_SERVER_DEV_MODE=1 "
    "taskset -c {cpu} {python} "
    "-m vllm.entrypoints.openai.api_server --model {{model}} --served-model-name {served} "
    "--host {{host}} --port {{port}} --enable-per-request-metrics --enforce-eager {{flags}}"
)


@dataclass(frozen=True)
class Case:
    """One run: a workload preset, its load flags (``servelab bench``'s), vLLM's flags."""

    name: str
    workload: str
    load: str
    flags: str = ""
    train: bool = False


TRAIN = Case("train chat c4", "chat", "--concurrency 4 --requests 16", train=True)
HELD_OUT = (
    Case("rag c4", "rag", "--concurrency 4 --requests 12"),
    Case("chat rate 1.2/s", "chat", "--rate 1.2 --requests 16"),
    Case("chat c8", "chat", "--concurrency 8 --requests 24"),
    Case("chat c4 budget 128", "chat", "--concurrency 4 --requests 16",
         "--max-num-batched-tokens 128"),
    Case("rag c4 no chunking", "rag", "--concurrency 4 --requests 12",
         "--no-enable-chunked-prefill"),
    Case("chat c4 no prefix cache", "chat", "--concurrency 4 --requests 16",
         "--no-enable-prefix-caching"),
)  # fmt: skip
SMOKE = ("chat c4 budget 128",)
LENGTH_SCALE = "0.5"


def run(cmd: list[str], log: Path) -> float:
    """Run ``cmd``, its output to ``log``; returns seconds. Raises on failure."""
    t0 = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if code not in (0, 3):  # 3: complete, the client marked invalid on a loaded machine
        raise RuntimeError(f"`{shlex.join(cmd)}` exited {code}: see {log}")
    return time.perf_counter() - t0


def reset_prefix_cache(url: str) -> None:
    """Empty the server's prefix cache (vLLM's dev-mode endpoint); raises when it cannot."""
    req = urllib.request.Request(f"{url}/reset_prefix_cache", method="POST", data=b"")
    with urllib.request.urlopen(req, timeout=30) as resp:
        if resp.status != 200:
            raise RuntimeError(f"POST {url}/reset_prefix_cache answered {resp.status}")


def bench(case: Case, url: str, weights: Path, out: Path, logs: Path) -> float:
    cmd = [
        "taskset", "-c", "0", *SERVELAB, "bench", "--url", url, "--tokenizer", str(weights),
        "--workload", case.workload, "--length-scale", LENGTH_SCALE, *shlex.split(case.load),
        "--server-config", f"vllm serve {weights} {case.flags}".strip(), "--out", str(out),
        "--quiet", "--seed", "1",
    ]  # fmt: skip
    return run(cmd, logs / f"bench-{out.name}.log")


def predict(case: Case, cal_path: Path, seeds: int, out: Path, logs: Path) -> float:
    cal = TwinCalibration.load(cal_path)
    changes = flag_changes(cal, case.flags)
    eng = " ".join(f"{k}={v}" for k, v in changes.items())
    cmd = [
        *SERVELAB, "sim", "--calibration", str(cal_path), "--workload", case.workload,
        "--length-scale", LENGTH_SCALE, *shlex.split(case.load), "--seed", "1",
        "--seeds", str(seeds), "--out", str(out), *(["--engine-args", eng] if eng else []),
    ]  # fmt: skip
    return run(cmd, logs / f"sim-{out.name}.log")


def measured(run_dir: Path) -> dict[str, float | None]:
    o = json.loads((run_dir / "metrics.json").read_text())["overall"]
    out: dict[str, float | None] = {}
    for name, metric, pct in FIGURES:
        out[name] = (
            o["throughput"]["output_tokens_per_s"] if metric is None else o["latency"][metric][pct]
        )
    return out


def compare(pred_dir: Path, run_dir: Path, tolerance: float) -> list[dict]:
    pred = json.loads((pred_dir / "prediction.json").read_text())["figures"]
    real = measured(run_dir)
    rows = []
    for name, _, _ in FIGURES:
        p, m = pred[name]["median"], real[name]
        lo, hi = pred[name]["interval"] or (None, None)
        err = (p - m) / m if p is not None and m else None
        rows.append(
            {
                "figure": name,
                "predicted": p,
                "range": [lo, hi],
                "measured": m,
                "error": err,
                "within": err is not None and abs(err) <= tolerance,
                "covered": m is not None and lo is not None and lo <= m <= hi,
            }
        )
    return rows


def _fmt(name: str, v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1e3:.1f}" if name != "output_tok_s" else f"{v:.1f}"


def render(results: list[dict]) -> str:
    lines = [
        "| case | figure | predicted | range over seeds | measured | error | in range |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for row in r["rows"]:
            n = row["figure"]
            lo, hi = row["range"]
            err = "-" if row["error"] is None else f"{row['error']:+.0%}"
            lines.append(
                f"| {r['case']} | {n}{' (ms)' if n != 'output_tok_s' else ''} | "
                f"{_fmt(n, row['predicted'])} | {_fmt(n, lo)}-{_fmt(n, hi)} | "
                f"{_fmt(n, row['measured'])} | {err} | {'yes' if row['covered'] else 'no'} |"
            )
    return "\n".join(lines)


def score(results: list[dict]) -> dict:
    rows = [row for r in results if not r["train"] for row in r["rows"] if row["error"] is not None]
    cases = [r for r in results if not r["train"]]
    return {
        "figures": len(rows),
        "within_tolerance": sum(r["within"] for r in rows),
        "covered": sum(r["covered"] for r in rows),
        "cases_mostly_covered": sum(
            sum(row["covered"] for row in r["rows"]) > len(r["rows"]) / 2 for r in cases
        ),
        "cases": len(cases),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/twin-vllm")
    ap.add_argument("--cases", default="smoke", help="smoke, all, or held-out case names")
    ap.add_argument("--vllm-python", default=VLLM_PYTHON)
    ap.add_argument("--weights", default=None, help="HF weights dir (default: exported)")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--tolerance", type=float, default=0.2)
    ap.add_argument("--health-timeout", type=float, default=900.0)
    ap.add_argument(
        "--reuse", action="store_true", help="calibrate and predict again on --out's real runs"
    )
    args = ap.parse_args()
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    weights = Path(args.weights) if args.weights else out / "weights"
    if not (weights / "config.json").exists():
        timings["export_s"] = run(
            [*SERVELAB, "export-hf", "--model", SERVED, str(weights)], logs / "export.log"
        )
    wanted = {
        "smoke": SMOKE,
        "all": tuple(c.name for c in HELD_OUT),
    }.get(args.cases, tuple(args.cases.split(",")))
    held = [c for c in HELD_OUT if c.name in wanted]
    template = TEMPLATE.format(cpu=1, python=args.vllm_python, served=SERVED)
    # One server per set of flags; the training case's first.
    groups: dict[str, list[Case]] = {TRAIN.flags: [TRAIN]}
    for c in held:
        groups.setdefault(c.flags, []).append(c)
    cal_path = out / "twin.json"
    results: list[dict] = []

    def evaluate(case: Case) -> None:
        slug = case.name.replace(" ", "-").replace("/", "")
        real = out / f"real-{slug}"
        if case.train:
            t1 = time.perf_counter()
            run([*SERVELAB, "calibrate", str(real), "--hardware", "cpu", "--server-config",
                 f"vllm serve {weights} {case.flags}".strip(), "--out", str(cal_path)],
                logs / "calibrate.log")  # fmt: skip
            timings["calibrate"] = time.perf_counter() - t1
        pred = out / f"sim-{slug}"
        shutil.rmtree(pred, ignore_errors=True)  # --reuse predicts again
        timings[f"predict {case.name}"] = predict(case, cal_path, args.seeds, pred, logs)
        results.append(
            {
                "case": case.name + (" (in-sample)" if case.train else ""),
                "train": case.train,
                "flags": case.flags,
                "rows": compare(pred, real, args.tolerance),
            }
        )

    if args.reuse:
        for case in [TRAIN, *HELD_OUT]:
            if (out / f"real-{case.name.replace(' ', '-').replace('/', '')}").is_dir():
                evaluate(case)
    for flags, cases in {} if args.reuse else groups.items():
        t0 = time.perf_counter()
        name = flags.strip("-").replace(" ", "_") or "default"
        server = TemplateServer(template, logs / f"vllm-{name}.log", str(weights), flags)
        try:
            asyncio.run(server.wait_healthy(timeout=args.health_timeout))
            timings[f"start vllm {name}"] = time.perf_counter() - t0
            # A fresh vLLM's first batches are several times slower (warm-up): not the
            # server a prediction is about.
            warm = Case("warm-up", "chat", "--concurrency 4 --requests 4", flags)
            timings[f"warm-up {name}"] = bench(
                warm, server.url, weights, out / f"warmup-{name}", logs
            )
            for case in cases:
                real = out / f"real-{case.name.replace(' ', '-').replace('/', '')}"
                # The warm-up and the earlier cases sent the same sessions (seed 1): without
                # this, the first turns hit blocks a cold twin never has.
                reset_prefix_cache(server.url)
                timings[f"bench {case.name}"] = bench(case, server.url, weights, real, logs)
                evaluate(case)
        finally:
            server.stop()
    timings["total_s"] = time.perf_counter() - t_start
    table = render(results)
    summary = score(results)
    (out / "results.json").write_text(
        json.dumps({"results": results, "score": summary, "timings": timings}, indent=1)
    )
    print(table)
    print(json.dumps(summary))
    print("timings (s):", json.dumps({k: round(v, 1) for k, v in timings.items()}))


if __name__ == "__main__":
    main()
