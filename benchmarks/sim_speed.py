"""How fast the simulator runs: the whole Azure conversational trace (19,366 requests, one
hour) on a simulated H200 serving Llama-3.1-8B, and where the time goes.

    .venv/bin/python benchmarks/sim_speed.py [--requests N] [--replicas R] [--profile]

Prints the wall time, the simulated span, steps and sequence-steps per second, and with
``--profile`` the functions that take the time (cProfile), split into the engine's
scheduler/KV cache/output processing and the simulator's own code. Target: the whole
trace in under 60 s on this machine. Quote figures as provisional on a shared machine.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

from servelab.engine.config import EngineConfig
from servelab.sim.loop import Simulation, Topology
from servelab.sim.target import roofline_target
from servelab.sim.workload import requests_from_trace

TRACE = "azure-2023-conv"  # the named trace the package ships


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=None, help="first N requests (default: all)")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--profile", action="store_true", help="cProfile the run")
    args = ap.parse_args()

    t0 = time.perf_counter()
    reqs, info = requests_from_trace(TRACE, max_requests=args.requests, max_model_len=131072)
    t_load = time.perf_counter() - t0
    target = roofline_target(
        "h200",
        "llama-3.1-8b",
        engine_config=EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=8192),
    )
    sim = Simulation(
        target.factory,
        reqs,
        Topology(replicas=args.replicas, router="least-loaded"),
        keep_steps=False,
    )
    prof = cProfile.Profile() if args.profile else None
    t0, c0 = time.perf_counter(), time.process_time()
    if prof:
        prof.enable()
    res = sim.run()
    if prof:
        prof.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    seq_steps = sum(r.output_tokens for r in res.records) + sum(
        1 for tl in res.timelines for _ in tl.chunks
    )
    print(
        f"trace: {len(reqs)} requests, {info['trace']['replayed']['span_s']:.0f} s span "
        f"(loaded in {t_load:.1f} s)"
    )
    print(
        f"simulated {res.sim_duration:.0f} s of an H200 x{args.replicas} serving Llama-3.1-8B "
        f"in {wall:.1f} s wall, {cpu:.1f} s CPU ({res.sim_duration / wall:.0f}x real time; "
        f"wall/CPU {wall / cpu:.2f}, above 1 when other processes take the CPU)"
    )
    print(f"requests simulated per wall second: {len(reqs) / wall:,.0f}")
    print(
        f"steps: {res.num_steps} ({res.num_steps / wall:.0f}/s); sequence-steps: {seq_steps} "
        f"({seq_steps / wall / 1e3:.0f}k/s, {cpu / seq_steps * 1e6:.1f} us CPU each)"
    )
    print(
        f"target < 60 s for the whole trace: wall {'met' if wall < 60 else 'NOT met'}, CPU "
        f"{'met' if cpu < 60 else 'NOT met'} "
        f"({'whole trace' if args.requests is None else f'{args.requests} requests only'})"
    )
    if prof:
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        st.sort_stats("tottime").print_stats(20)
        print(s.getvalue())
        by_module: dict[str, float] = {}
        for (file, _, _), (_, _, tt, _, _) in st.stats.items():  # type: ignore[attr-defined]
            key = next(
                (
                    m
                    for m in (
                        "engine/scheduler",
                        "engine/kv_cache",
                        "engine/engine",
                        "engine/request",
                        "engine/detokenizer",
                        "sim/",
                    )
                    if m in file
                ),
                "other",
            )
            by_module[key] = by_module.get(key, 0.0) + tt
        total = sum(by_module.values())
        print("own time by module:")
        for k, v in sorted(by_module.items(), key=lambda kv: -kv[1]):
            print(f"  {k:20s} {v:7.1f} s  {v / total:5.1%}")


if __name__ == "__main__":
    main()
