"""Score ``servelab sim`` on 51 real vLLM 0.15.1 GPU runs (BLIS's sim-to-real campaign)
beside the simulators BLIS published for the same runs.

    python -m benchmarks.sim.gpu_runs [--split eval|fit|all] [--runs ID,...] [--jobs N]
                                      [--seed S] [--json FILE] [--per-stage]

Each run of ``benchmarks/sim/data/blis_vllm_runs.json`` becomes one simulation: its model
(shapes from its ``config.json``), GPU, tensor parallelism, token budget and memory fraction
on the simulated vLLM's defaults for that GPU, with ``--max-num-seqs 128`` and
``--max-model-len 4096`` as the campaign launched it, and the requests its load generator
(inference-perf at the pinned commit) really sent: 100 prompts, 10 groups of 10 that share
a system prompt, request n of a stage sending prompt n % 100 with ``ignore_eos`` and the
profile's output length; each stage's arrivals are exponential gaps rescaled to sum to the
stage's duration, and a stage starts once the one before has drained. The whole-run and
per-stage TTFT and E2E (mean, p90, p99) are compared with the measured ones; the summary is
the median absolute error over the runs each simulator represents. ITL is not scored: that
load generator's output-token counts are unreliable.

A run the simulator cannot represent (a model or GPU it cannot price) is listed with the
reason. Nothing is downloaded: the data file holds every figure, with its sources.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data" / "blis_vllm_runs.json"
METRICS = ("ttft_mean", "ttft_p90", "ttft_p99", "e2e_mean", "e2e_p90", "e2e_p99")
SCORED = ("ttft_mean", "ttft_p99", "e2e_mean", "e2e_p99")
PEERS = {
    "blis-trained-physics": "blis-tr",
    "blis-roofline": "blis-rf",
    "aiconfigurator-estimate": "aiconf",
    "llm-optimizer-estimate": "llm-opt",
    "vidur": "vidur",
}
HARDWARE = {"H100": "h100", "A100-80GB": "a100", "L40S": "l40s"}
STAGE_GAP_S = 30.0  # idle time between stages: each stage drains before the next starts
NUM_GROUPS, PROMPTS_PER_GROUP = 10, 10  # inference-perf's SharedPrefix defaults


def load_data(path: Path = DATA) -> dict[str, Any]:
    return json.loads(path.read_text())


def model_spec(name: str, config: dict[str, Any], max_model_len: int) -> Any:
    """The simulator's shapes of a model from its ``config.json`` (ValueError if refused)."""
    from servelab.sim.costs.model_shapes import load_model_spec

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / name.split("/")[-1] / "config.json"
        p.parent.mkdir()
        p.write_text(json.dumps(config))
        spec = load_model_spec(str(p))
    return replace(spec, max_model_len=max_model_len)


def make_target(run: dict[str, Any], data: dict[str, Any], engine_only: bool = False) -> Any:
    """The simulated vLLM of ``run``; ValueError saying why when it cannot be represented.
    ``engine_only``: without the server around the engine (its serving path)."""
    from servelab.sim.costs.hardware import get_hardware
    from servelab.sim.sim_target import roofline_target

    launch = data["launch"]
    hw = HARDWARE[run["hardware"]]
    spec = model_spec(run["model"], data["models"][run["model"]], launch["max_model_len"])
    util = run["gpu_memory_utilization"]
    if run["cpu_offload"]:
        # --cpu-offload-gb moves that much of each GPU's weights to host memory, leaving it
        # to the KV cache; the PCIe reads it adds to a step are not modelled (docs/design).
        util += launch["cpu_offload_gb"] * 1e9 / (get_hardware(hw).memory_bytes or 1.0)
    target = roofline_target(
        hw,
        spec,
        tp=run["tp"],
        engine="vllm",
        engine_args={
            "max_num_seqs": launch["max_num_seqs"],
            "max_num_batched_tokens": run["max_num_batched_tokens"],
            "block_size": launch["block_size"],
        },
        gpu_memory_utilization=util,
        dtype="fp8" if run["precision"] == "FP8" else None,
    )
    return replace(target, serving_path=None) if engine_only else target


def make_requests(workload: dict[str, Any], seed: int) -> tuple[list[Any], list[float]]:
    """The requests inference-perf sent for ``workload``, and each stage's start time."""
    from servelab.sim.loop.simulation import SimRequest

    rng = random.Random(seed)
    sys_len, q_len = workload["system_prompt_len"], workload["question_len"]

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, 30000) for _ in range(n)]

    prompts = []
    for _ in range(NUM_GROUPS):
        prefix = [1, *ids(sys_len)]  # BOS, then the group's system prompt
        prompts += [prefix + ids(q_len) for _ in range(PROMPTS_PER_GROUP)]
    rng.shuffle(prompts)
    reqs: list[Any] = []
    starts: list[float] = []
    t0 = 0.0
    for k, (rate, duration) in enumerate(workload["stages"]):
        n = int(rate * duration)
        gaps = [rng.expovariate(rate) for _ in range(n)]
        scale = duration / sum(gaps)
        starts.append(t0)
        t = t0
        for i, g in enumerate(gaps):
            t += g * scale
            reqs.append(
                SimRequest(
                    f"s{k}-{i}",
                    t,
                    prompts[i % len(prompts)],
                    workload["output_len"],
                    stage=str(k),
                )
            )
        t0 = t + STAGE_GAP_S + workload["output_len"] * 0.1
    return reqs, starts


def _pct(xs: list[float], q: float) -> float:
    """numpy's default (linear) percentile, as inference-perf reports."""
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def figures(records: list[Any]) -> dict[str, float]:
    ttft = [r.ttft * 1e3 for r in records if r.ok and r.ttft is not None]
    e2e = [r.e2e * 1e3 for r in records if r.ok and r.e2e is not None]
    out: dict[str, float] = {}
    for name, xs in (("ttft", ttft), ("e2e", e2e)):
        if xs:
            out[f"{name}_mean"] = statistics.fmean(xs)
            out[f"{name}_p90"] = _pct(xs, 90)
            out[f"{name}_p99"] = _pct(xs, 99)
    return out


def simulate_run(
    run: dict[str, Any], data: dict[str, Any], seed: int, engine_only: bool = False
) -> dict[str, Any]:
    """{stage: figures} of one run ("-1" is the whole run), or {"refused": reason}."""
    from servelab.sim.scenario import Scenario, simulate

    try:
        target = make_target(run, data, engine_only)
    except ValueError as e:
        return {"refused": str(e).splitlines()[0][:90]}
    reqs, _ = make_requests(data["workloads"][run["workload"]], seed)
    res = simulate(Scenario(target=target, requests=reqs), keep_steps=False)
    failed = [r for r in res.records if not r.ok]
    by_stage: dict[str, list[Any]] = {}
    for r in res.records:
        by_stage.setdefault(r.stage or "0", []).append(r)
    out: dict[str, Any] = {"-1": figures(res.records), "failed": len(failed)}
    for k, recs in by_stage.items():
        out[k] = figures(recs)
    return out


def _job(args: tuple[dict[str, Any], dict[str, Any], int, bool]) -> tuple[str, dict[str, Any]]:
    run, data, seed, engine_only = args
    return run["id"], simulate_run(run, data, seed, engine_only)


def error(pred: float | None, actual: float | None) -> float | None:
    if pred is None or actual is None or actual == 0:
        return None
    return (pred - actual) / actual * 100


def score(
    runs: list[dict[str, Any]], sims: dict[str, dict[str, Any]], stage: str = "-1"
) -> dict[str, dict[str, list[float]]]:
    """Signed % errors per simulator per metric over the runs each one predicts."""
    out: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        meas = run["measured"].get(stage, {})
        preds = {"servelab": sims.get(run["id"], {}).get(stage, {})}
        preds.update({p: run["peers"].get(p, {}).get(stage, {}) for p in PEERS})
        for who, fig in preds.items():
            for m in METRICS:
                e = error(fig.get(m), meas.get(m))
                if e is not None:
                    out.setdefault(who, {}).setdefault(m, []).append(e)
    return out


def _fmt(e: float | None) -> str:
    return "-" if e is None else f"{e:+.1f}%"


def print_runs(runs: list[dict[str, Any]], sims: dict[str, dict[str, Any]], stages: bool) -> None:
    cols = ["servelab", *PEERS]
    head = f"{'run':<40} {'stage':>5} {'metric':<9} {'measured':>9} " + " ".join(
        f"{PEERS.get(c, c):>9}" for c in cols
    )
    print(head)
    for run in runs:
        sim = sims.get(run["id"], {})
        if "refused" in sim:
            print(f"{run['id'][:40]:<40} not represented: {sim['refused']}")
            continue
        for st in sorted(run["measured"]) if stages else ["-1"]:
            meas = run["measured"].get(st, {})
            for m in SCORED:
                preds = [sim.get(st, {}).get(m)] + [
                    run["peers"].get(p, {}).get(st, {}).get(m) for p in PEERS
                ]
                errs = " ".join(f"{_fmt(error(p, meas.get(m))):>9}" for p in preds)
                print(f"{run['id'][:40]:<40} {st:>5} {m:<9} {meas.get(m, 0):>9.1f} {errs}")


def print_summary(runs: list[dict[str, Any]], sims: dict[str, dict[str, Any]]) -> None:
    ours = [r for r in runs if "-1" in sims.get(r["id"], {})]
    for title, subset in (
        ("the runs each simulator predicts", runs),
        (f"the {len(ours)} runs servelab represents", ours),
    ):
        errs = score(subset, sims)
        print(f"\nmedian |error|, whole run, over {title}:")
        print(f"{'simulator':<22} {'runs':>4} " + " ".join(f"{m:>9}" for m in METRICS))
        for who in ["servelab", *PEERS]:
            if who not in errs:
                continue
            n = max(len(v) for v in errs[who].values())
            cells = []
            for m in METRICS:
                v = errs[who].get(m)
                med = statistics.median(abs(x) for x in v) if v else None
                cells.append(f"{med:>8.1f}%" if med is not None else f"{'-':>9}")
            print(f"{who:<22} {n:>4} " + " ".join(cells))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", choices=("eval", "fit", "all"), default="eval")
    ap.add_argument("--runs", default="", help="comma-separated run ids (prefixes)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-stage", action="store_true", help="print every load stage")
    ap.add_argument("--json", type=Path, help="write the simulated figures here")
    ap.add_argument("--engine-only", action="store_true", help="without the server's serving path")
    args = ap.parse_args(argv)
    data = load_data()
    runs = [r for r in data["runs"] if args.split in ("all", r["split"])]
    if args.runs:
        wanted = args.runs.split(",")
        runs = [r for r in runs if any(r["id"].startswith(w) for w in wanted)]
    if not runs:
        print("no run matches", file=sys.stderr)
        return 2
    jobs = [(r, data, args.seed, args.engine_only) for r in runs]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as ex:
            sims = dict(ex.map(_job, jobs))
    else:
        sims = dict(map(_job, jobs))
    print_runs(runs, sims, args.per_stage)
    print_summary(runs, sims)
    if args.json:
        args.json.write_text(json.dumps(sims, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
