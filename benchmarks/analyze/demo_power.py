"""Plan `servelab demo`'s sizes: each question's power and time, simulated over many seeds.

Every candidate size of every question runs baseline and treatment in the simulator on
this machine's measured step times (a `servelab profile` table, e.g. built with
`servelab profile --from-run` from a real demo's run directories), over ``--seeds``
plan seeds with matching step-noise seeds, and the demo's own verdict logic
(``analyze.answers.answer``) judges each pair. It prints, per question and size, how
often the verdict is "significant" (the power, where the effect is real), the median
effect, the simulated wall time of both sides, and how many requests the key metric
measured (a question with a population filter, ``Question.during``, keeps some only):
the demo takes the smallest size whose power is high and whose time fits. spec_decode and
disaggregation are not here: the simulator prices neither drafts nor two workers sharing a
core, so they were sized on real runs (docs/reading-the-report.md).

    python -m benchmarks.analyze.demo_power --profile demo-profile.json --seeds 20
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
from pathlib import Path
from typing import Any

import yaml

from servelab.analyze.answers import measure
from servelab.analyze.compare import DEFAULT_ALPHA, STATS
from servelab.bench.workloads.request_plan import LoadSpec
from servelab.engine.engine_config import EngineConfig
from servelab.rundir import load_run
from servelab.sim.costs.profiled import ProfileTable
from servelab.sim.engine_args import parse_engine_args, split_deployment
from servelab.sim.loop.simulation import Topology
from servelab.sim.run_writer import write_run_dir
from servelab.sim.scenario import Scenario, load_requests, simulate
from servelab.sim.sim_target import profile_target
from servelab.workflows import demo


def _target(table: ProfileTable, flags: str) -> Any:
    eng, _ = split_deployment(parse_engine_args(flags))
    # The table keeps the engine config of the runs it was built from; the policy flags
    # come from the demo's server flags alone (engine defaults where they say nothing).
    policy = ("enable_prefix_caching", "enable_chunked_prefill", "max_num_seqs")
    policy += ("max_num_batched_tokens",)
    meta = {k: v for k, v in table.meta.get("engine_config", {}).items() if k not in policy}
    base = EngineConfig(**meta)
    return profile_target(table, dataclasses.replace(base, **eng))


def _run(
    table: ProfileTable, flags: str, spec: dict[str, Any], n: int, conc: int, seed: int, d: Path
) -> tuple[Any, float]:
    target = _target(table, flags)
    wl = d / f"{spec['name']}.yaml"
    wl.parent.mkdir(parents=True, exist_ok=True)
    wl.write_text(yaml.safe_dump(spec, sort_keys=False))
    load = LoadSpec(concurrency=conc, requests=n)
    max_len = target.engine_config.max_model_len or target.max_model_len
    reqs, info, slos = load_requests(
        str(wl), load, seed, max_len, resend=target.resend, sim_seed=seed
    )
    res = simulate(Scenario(target, reqs, Topology(), 0.0, conc, slos, info, seed))
    run_dir = write_run_dir(
        d / "run",
        res,
        target=target.describe(),
        workload=info.get("workload"),
        load=info.get("load"),
        slos=slos,
        write_steps=False,
        n_boot=50,
    )
    run = load_run(run_dir)
    ends = [r.done for r in run.records if r.done is not None]
    starts = [r.actual_send for r in run.records]
    return run, (max(ends) - min(starts)) if ends else 0.0


def _question(
    table: ProfileTable,
    qid: str,
    sides: list[tuple[str, dict[str, Any]]],
    n: int,
    conc: int,
    seeds: int,
    tmp: Path,
) -> None:
    q = demo.QUESTIONS[qid]
    scope, metric, _ = q.metric
    found: dict[str, list[tuple[bool, float, float]]] = {s: [] for s in STATS}
    walls, counts = [], []
    for seed in range(1, seeds + 1):
        runs, wall = [], 0.0
        for i, (flags, spec) in enumerate(sides):
            run, w = _run(table, flags, spec, n, conc, seed, tmp / f"{qid}-{n}-{seed}-{i}")
            runs.append(run)
            wall += w
        walls.append(wall)
        for stat in STATS:
            m = measure([runs[0]], [runs[1]], (scope, metric, stat), seed, q.during)
            p = 1.0 if m.p_value is None else m.p_value
            found[stat].append((p <= DEFAULT_ALPHA and (m.delta or 0) < 0, m.delta or 0.0, p))
        counts.append(min(m.counts))
    # A population filter (Question.during) keeps some of the requests, and few cannot give
    # a verdict whatever the effect: the most extreme split of 3 vs 3 has p = 2/20, of 4 vs 4
    # 2/70.
    print(
        f"{qid} {metric} ({scope}) n={n} c={conc}: sim wall {statistics.median(walls):.0f} s; "
        f"requests measured, smaller side: median {statistics.median(counts):.0f}, "
        f"min {min(counts)}"
    )
    for stat, rows in found.items():
        ds = [d for _, d, _ in rows]
        print(
            f"  {stat:5s} power {sum(ok for ok, _, _ in rows) / seeds:4.0%}  delta median "
            f"{statistics.median(ds):+.0%} (range {min(ds):+.0%} .. {max(ds):+.0%})  "
            f"p max {max(p for _, _, p in rows):.3g}",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--question", action="append", help="only these question ids")
    ap.add_argument("--sizes", default="", help="qid=n:c,n:c;qid=... candidate sizes")
    args = ap.parse_args()
    table = ProfileTable.load(args.profile)
    s = demo.SERVERS
    sides = {
        "rag_ttft": [
            (s["uncached"], demo.rag_workload(1.0)),
            (s["cached"], demo.rag_workload(1.0)),
        ],
        "chunked_prefill": [
            (s["unchunked"], demo.mixed_workload(1.0)),
            (s["cached"], demo.mixed_workload(1.0)),
        ],
        "priorities": [
            (s["two-seqs"], demo.priority_workload(1.0, 0)),
            (s["two-seqs"], demo.priority_workload(1.0, 1)),
        ],
    }
    sizes: dict[str, list[tuple[int, int]]] = {
        q: [(demo.FULL.requests[q], demo.FULL.concurrency[q])] for q in sides
    }
    for part in filter(None, args.sizes.split(";")):
        q, _, pts = part.partition("=")
        sizes[q] = [(int(a), int(b)) for a, b in (p.split(":") for p in pts.split(","))]
    with tempfile.TemporaryDirectory() as tmp:
        for qid, pair in sides.items():
            if args.question and qid not in args.question:
                continue
            for n, c in sizes[qid]:
                _question(table, qid, pair, n, c, args.seeds, Path(tmp))


if __name__ == "__main__":
    main()
