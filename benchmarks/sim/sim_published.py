"""Simulate published GPU measurements (benchmarks/published_gpu.yaml) and print the error
of every figure.

    python -m benchmarks.sim.sim_published [--requests N] [--only SUBSTRING] [--jobs J]

Each point runs on the simulated vLLM engine's defaults for its hardware (the offline class
for offline and batch-latency runs), in its published datatypes, with fixed lengths and a
distinct first block per request (no prefix-cache hits, as with random-token prompts):

- ``offline``: every request queued at time 0; output tokens / simulated duration;
- ``latency``: one batch at time 0; the batch's end-to-end latency (its last request);
- ``concurrency``: a closed loop of ``concurrency`` clients; TTFT p50, ITL p50 (the median
  request's TPOT, which is what AIPerf's per-request ITL is) and output throughput.

Scoring: output throughput, ITL and batch latency within 15%, TTFT within 25%. A figure of a
faster engine (``bound: faster-engine``) is a bound for a vLLM simulation: it counts as met
unless the simulation beats it by more than the tolerance (more throughput, less latency);
the two-sided count is printed beside it.

Calibration, chosen before any error was looked at: every third point of each source in
file order (the 1st, 4th, 7th, ...) is the training set; one factor ``s`` speeds every step
up by ``s`` (MFU and MBU times ``s``, fixed costs and communication divided by it), ``s``
being the geometric mean over the training figures of how much faster the published run
was than the default simulation. None of these runs' schedules depends on step times
(everything queued at once, or a closed loop without network delay), so the fitted figures
are the default ones scaled exactly by ``s``; the other points are held out. Requests are
capped at ``--requests`` (the published offline runs go to 30,000), so the drain at the end
weighs more than in the published runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from servelab.sim.costs.roofline import Efficiency
from servelab.sim.loop.simulation import SimRequest, Simulation, Topology
from servelab.sim.sim_target import roofline_target

DATA = Path(__file__).with_name("published_gpu.yaml")
TOLERANCE = {"output_tok_s": 0.15, "itl_ms": 0.15, "latency_ms": 0.15, "ttft_ms": 0.25}
HIGHER_IS_FASTER = {"output_tok_s"}


def simulate(p: dict[str, Any], eff: Efficiency, cap: int) -> tuple[dict[str, float], float]:
    """The point's figures as simulated with ``eff``, and the wall seconds it took."""
    kind = p["kind"]
    target = roofline_target(
        p["hardware"],
        p["model"],
        tp=p["tp"],
        efficiency=eff,
        dtype=p["dtype"],
        kv_dtype=p["kv_dtype"],
        engine="vllm",
        offline=kind != "concurrency",
    )
    if p["bound"] == "faster-engine":
        # TensorRT-LLM and NIM: their server is not vLLM's, so not its fitted serving path.
        target = dataclasses.replace(target, serving_path=None)
    c = p.get("concurrency")
    n = min(p["requests"] if "requests" in p else max(4 * c, 20), cap)
    isl, osl = p["input_len"], p["output_len"]
    reqs = [
        SimRequest(
            request_id=f"r{i}", send_time=0.0, prompt_token_ids=[i + 1] * isl, max_tokens=osl
        )
        for i in range(n)
    ]
    t0 = time.perf_counter()
    res = Simulation(target.factory, reqs, Topology(), max_concurrency=c, keep_steps=False).run()
    wall = time.perf_counter() - t0
    recs = [r for r in res.records if r.ok]
    out = sum(r.output_tokens for r in recs)
    if kind == "offline":
        return {"output_tok_s": out / res.sim_duration}, wall
    if kind == "latency":
        first = min(r.actual_send for r in recs)
        return {"latency_ms": 1e3 * (max(r.done or first for r in recs) - first)}, wall
    ttfts = [r.ttft for r in recs if r.ttft is not None]
    tpots = [r.tpot for r in recs if r.tpot is not None]
    return {
        "ttft_ms": 1e3 * statistics.median(ttfts),
        "itl_ms": 1e3 * statistics.median(tpots),
        "output_tok_s": out / res.sim_duration,
    }, wall


def load_points(only: str | None) -> list[dict[str, Any]]:
    """Every point with its source's settings, and whether it is in the training set."""
    data = yaml.safe_load(DATA.read_text())
    points = []
    for src in data["sources"]:
        for i, p in enumerate(src["points"]):
            points.append(
                {
                    "source": src["id"],
                    "kind": src["kind"],
                    "dtype": src["dtype"],
                    "kv_dtype": src["kv_dtype"],
                    "bound": src["bound"],
                    "train": i % 3 == 0,
                    **p,
                }
            )
    return [p for p in points if not only or only in p["id"]]


def figures(p: dict[str, Any]) -> list[str]:
    return [f for f in TOLERANCE if f in p]


def speedup(p: dict[str, Any], f: str, sim: float) -> float:
    """How much faster the published run was than the simulation on figure ``f``."""
    return p[f] / sim if f in HIGHER_IS_FASTER else sim / p[f]


def met(p: dict[str, Any], f: str, err: float) -> tuple[bool, bool]:
    """(met as scored, met two-sided) for signed error ``err`` of figure ``f``."""
    tol = TOLERANCE[f]
    two_sided = abs(err) <= tol
    if p["bound"] != "faster-engine":
        return two_sided, two_sided
    return (err <= tol if f in HIGHER_IS_FASTER else err >= -tol), two_sided


def run_all(
    points: list[dict[str, Any]], eff: Efficiency, cap: int, jobs: int
) -> list[dict[str, float]]:
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(simulate, p, eff, cap) for p in points]
        out = []
        for p, fut in zip(points, futures, strict=True):
            sim, wall = fut.result()
            shown = ", ".join(f"{f} {v:,.1f}" for f, v in sim.items())
            print(f"  {p['id']}: {shown} ({wall:.1f} s)", flush=True)
            out.append(sim)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=600, help="cap on requests per point")
    ap.add_argument("--only", default=None, help="simulate only points whose id contains this")
    ap.add_argument("--jobs", type=int, default=2, help="points simulated in parallel")
    args = ap.parse_args()
    points = load_points(args.only)
    base = Efficiency()
    print(f"default efficiencies: {base.to_dict()}")
    default = run_all(points, base, args.requests, args.jobs)
    logs = [
        math.log(speedup(p, f, sim[f]))
        for p, sim in zip(points, default, strict=True)
        if p["train"]
        for f in figures(p)
    ]
    s = math.exp(sum(logs) / len(logs)) if logs else 1.0
    print(
        f"\ncalibration: {sum(p['train'] for p in points)} of {len(points)} points "
        f"({len(logs)} figures; every third of each source): s = {s:.3f}, i.e. MFU "
        f"{base.mfu * s:.2f}, MBU {base.mbu * s:.2f}, step overhead "
        f"{base.step_overhead / s * 1e3:.2f} ms\n"
    )
    calibrated = [
        {f: v * s if f in HIGHER_IS_FASTER else v / s for f, v in sim.items()} for sim in default
    ]
    print(
        f"\n{'point':34s} {'figure':12s} {'published':>10s} {'default':>10s} {'err':>7s} "
        f"{'fitted':>10s} {'err':>7s}  set"
    )
    held = ok = ok2 = 0
    by_figure: dict[str, list[int]] = {}
    for p, d, c in zip(points, default, calibrated, strict=True):
        for f in figures(p):
            e0, e1 = d[f] / p[f] - 1, c[f] / p[f] - 1
            scored, two = met(p, f, e1)
            tag = "train" if p["train"] else ("held: ok" if scored else "held: MISS")
            if not p["train"]:
                held += 1
                ok += scored
                ok2 += two
                tally = by_figure.setdefault(f, [0, 0])
                tally[0] += scored
                tally[1] += 1
            print(
                f"{p['id']:34s} {f:12s} {p[f]:10,.1f} {d[f]:10,.1f} {e0:+7.1%} "
                f"{c[f]:10,.1f} {e1:+7.1%}  {tag}"
            )
    print(
        f"\nheld out, met as scored (faster-engine figures as bounds): {ok} of {held} "
        f"({ok / max(held, 1):.0%}; target: three quarters)"
    )
    print(f"held out, within tolerance two-sided: {ok2} of {held}")
    for f, (a, b) in by_figure.items():
        print(f"  {f}: {a} of {b} (tolerance {TOLERANCE[f]:.0%})")


if __name__ == "__main__":
    main()
