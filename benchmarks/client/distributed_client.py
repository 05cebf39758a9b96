"""Where does one client process stop being enough? 1, 2 and 4 workers at rising stream counts.

The deterministic test server streams every request on a known schedule and records
when it wrote each chunk. A closed loop of N streams (each stream sends ``--per-stream``
requests of ``--tokens`` tokens, one every ``--itl`` seconds) runs through the
distributed bench's ``WorkerPool`` with 1, 2 and 4 local worker processes. On one host
every process shares the monotonic clock, so each chunk's timing error is ``client stamp
- server write``. Per level the script prints the error p50/p99, the streamed tokens/s
sustained against the tokens/s offered, the client CPU (all workers, and the busiest
worker's share of a core) and the run's own verdict. Where the error grows and the
verdict turns invalid for one worker but not for several, one process was not enough.

On a small shared machine the test server and the workers compete for the same cores,
and the test server (one process) saturates first: tokens/s then stops following the
offer whatever the worker count, and at the largest levels requests time out or are cut
(the ``errors`` column). Read the figures side by side, as ratios, never as absolutes;
the client's limit shows only where the server has cores of its own.

    python -m benchmarks.client.distributed_client            # up to 2,000 streams
    python -m benchmarks.client.distributed_client --quick    # a short check
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from benchmarks.common import fetch_timelines
from servelab.bench.client.event_loop import run_loop
from servelab.bench.client.send import Target
from servelab.bench.distributed.driver import DistributedStage, WorkerPool
from servelab.bench.workloads.request_plan import LoadSpec
from servelab.rundir import server_id
from servelab.testing.testserver import Schedule, run_test_server
from servelab.testing.tokenizers import one_request
from servelab.vocab import RequestTags


async def _level(
    pool: WorkerPool, url: str, streams: int, args: argparse.Namespace
) -> dict[str, float | str]:
    n = streams * args.per_stream
    tags = RequestTags(workload_class="stream")
    plan = [
        one_request(f"r{i:06d}", "hello", args.tokens, index=i, prompt_tokens=1, tags=tags)
        for i in range(n)
    ]
    load = LoadSpec(concurrency=streams, requests=n)
    tag = f"w{len(pool.workers)}s{streams}"
    stage: DistributedStage = await pool.run_stage(plan, load, run_tag=tag)
    recs = stage.result.records
    failed = [r for r in recs if not r.ok]
    tls = await fetch_timelines(url, [server_id(r) for r in recs if r.ok])
    errors = []
    for r in recs:
        tl = tls.get(server_id(r))
        if tl is None or not r.ok or len(tl["token_times"]) != len(r.chunk_times):
            continue
        errors.append(np.asarray(r.chunk_times) - np.asarray(tl["token_times"]))
    e = np.concatenate(errors) * 1e3 if errors else np.array([np.nan])
    wall = stage.result.end - stage.result.start
    h = stage.health
    return {
        "err_p50_ms": float(np.percentile(e, 50)),
        "err_p99_ms": float(np.percentile(e, 99)),
        "tokens_per_s": sum(r.output_tokens for r in recs if r.ok) / wall,
        "offered_per_s": streams / args.itl,
        "cpu_s": h.cpu_seconds,
        "busiest": h.cpu_utilisation,
        "failed": len(failed),
        "errors": ",".join(sorted({(r.error or "").split(":", 1)[0] for r in failed})),
        "verdict": "ok" if h.valid else "INVALID: " + h.reasons[0].split(": ", 1)[-1][:60],
    }


async def _workers(url: str, n: int, ladder: list[int], args: argparse.Namespace) -> None:
    target = Target(url, "test-model", timeout=600.0)
    pool = await WorkerPool.start(n, target)
    try:
        for streams in ladder:
            m = await _level(pool, url, streams, args)
            print(
                f"{n:7d} {streams:7d} {m['err_p50_ms']:8.2f} {m['err_p99_ms']:8.2f} "
                f"{m['tokens_per_s']:9.0f} {m['tokens_per_s'] / m['offered_per_s']:8.0%} "
                f"{m['cpu_s']:7.1f} {m['busiest']:8.0%} {m['failed']:6d} {m['errors'] or '-':>8}  "
                f"{m['verdict']}",
                flush=True,
            )
    finally:
        await pool.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 and 2 workers, 20 and 100 streams")
    ap.add_argument("--itl", type=float, default=0.05, help="seconds between a stream's tokens")
    ap.add_argument("--tokens", type=int, default=40, help="output tokens per request")
    ap.add_argument("--per-stream", type=int, default=2, help="requests each stream sends")
    ap.add_argument("--workers", help="worker counts, e.g. 1,4 (default 1,2,4)")
    ap.add_argument("--streams", help="stream counts, e.g. 500,2000 (default up to 2,000)")
    args = ap.parse_args()
    workers = [1, 2] if args.quick else [1, 2, 4]
    ladder = [20, 100] if args.quick else [50, 200, 500, 1000, 2000]
    if args.workers:
        workers = [int(x) for x in args.workers.split(",")]
    if args.streams:
        ladder = [int(x) for x in args.streams.split(",")]
    print(
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (other load inflates "
        f"every figure); {args.tokens} tokens per request, one every {args.itl * 1e3:.0f} ms"
    )
    print(
        f"{'workers':>7} {'streams':>7} {'err p50':>8} {'err p99':>8} {'tok/s':>9} "
        f"{'of offer':>8} {'cpu s':>7} {'busiest':>8} {'failed':>6} {'errors':>8}  verdict"
    )
    with run_test_server(Schedule(ttft=0.05, itl=args.itl)) as url:
        for n in workers:
            run_loop(_workers(url, n, ladder, args))


if __name__ == "__main__":
    main()
