"""Disaggregated prefill/decode vs colocated serving on the `mixed` workload, side by side.

Three `servelab serve` configurations of the same model, started once and kept for the
session (through ``servelab bench``'s own launcher and ``bench.matrix``):

1. ``colocated-unchunked``: one engine, chunked prefill off (a long prompt stalls decodes);
2. ``colocated-chunked``: one engine, chunked prefill with a 256-token step budget;
3. ``disagg-1p1d``: ``--disaggregated``, one prefill and one decode worker.

For each rate (rising), every configuration runs the same planned requests (the `mixed`
workload: long RAG prompts, streaming chat sessions and code generation), in an order
rotated per repeat, so machine drift spreads over all three. The table reports TTFT and ITL
p50/p99, goodput under the workload's SLOs, output throughput and, for the disaggregated
server, the KV transfer time against TTFT (from the server timelines' ``kv_transfer``).

CPU budget: the launcher pins every server to all CPUs but the first and the benchmark
client to the first. On a 2-CPU machine each server therefore gets ONE core: the colocated
engine runs one thread on it; the two disaggregated workers (one thread each) time-share it
through the OS scheduler. Figures are provisional on a shared machine; compare ratios.

    python -m benchmarks.server.disagg --quick            # a few minutes: checks it all works
    python -m benchmarks.server.disagg --rates 0.1,0.2,0.4 --requests 12 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from servelab.analyze.server_side.phase_costs import kv_transfers
from servelab.analyze.summary import run_summary
from servelab.bench.run import DEFAULT_MODEL, BenchOptions
from servelab.bench.workloads.request_plan import LoadSpec
from servelab.rundir import load_run
from servelab.workflows.matrix import MatrixConfig, MatrixSpec, execute_matrix, start_servers

KV = "--kv-cache-memory 0.5G"
CONFIGS = {
    "colocated-unchunked": f"--no-enable-chunked-prefill {KV}",
    "colocated-chunked": f"--max-num-batched-tokens 256 {KV}",
    "disagg-1p1d": f"--disaggregated --prefill-workers 1 --decode-workers 1 {KV}",
}


@dataclass(kw_only=True)
class Size:
    rates: list[float]  # sessions/s, rising
    requests: int  # sessions per run
    length_scale: float
    repeats: int
    stage_seconds: float


QUICK = Size(rates=[0.3, 1.0], requests=4, length_scale=0.15, repeats=1, stage_seconds=15.0)
FULL = Size(rates=[0.1, 0.2, 0.4], requests=12, length_scale=0.5, repeats=2, stage_seconds=90.0)


def row(run_dir: Path) -> dict[str, Any]:
    run = load_run(run_dir)
    s = run_summary(run)["overall"]
    lat = s["latency"]
    out = {
        "valid": run.valid,
        "ok": s["requests"]["ok"],
        "sent": s["requests"]["sent"],
        "ttft_p50": lat["ttft"].get("p50"),
        "ttft_p99": lat["ttft"].get("p99"),
        "itl_p50": lat["itl"].get("p50"),
        "itl_p99": lat["itl"].get("p99"),
        "goodput": s["goodput"]["requests_per_s"],
        "goodput_fraction": s["goodput"]["fraction"],
        "out_tok_s": s["throughput"]["output_tokens_per_s"],
    }
    share = kv_transfers([run])
    if share:
        out["kv"] = share
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.0f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes: check that it works")
    ap.add_argument("--rates", help="comma-separated sessions/s, rising (default by size)")
    ap.add_argument("--requests", type=int, help="sessions per run")
    ap.add_argument("--length-scale", type=float, help="scale the workload's token lengths")
    ap.add_argument("--repeats", type=int, help="runs per config and rate (interleaved)")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    size = QUICK if a.quick else FULL
    if a.rates:
        size.rates = sorted(float(r) for r in a.rates.split(","))
    size.requests = a.requests or size.requests
    size.length_scale = a.length_scale or size.length_scale
    size.repeats = a.repeats or size.repeats
    out = a.out or Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-disagg"
    out.mkdir(parents=True, exist_ok=True)
    console = Console(width=150)
    servers = start_servers(CONFIGS, out, a.model, console=console)
    spec = MatrixSpec([MatrixConfig(n, args) for n, args in CONFIGS.items()], size.repeats)
    results: dict[float, dict[str, list[dict[str, Any]]]] = {}
    try:
        for rate in size.rates:
            load = LoadSpec(
                rate=rate,
                requests=size.requests,
                duration=size.stage_seconds,
                length_scale=size.length_scale,
            )
            base = BenchOptions(
                tokenizer=a.model,
                workload="mixed",
                load=load,
                out=out / f"rate-{rate:g}",
                seed=1,
                quiet=True,
                command=[
                    "python",
                    "-m",
                    "benchmarks.server.disagg",
                    f"(mixed at {rate:g} sessions/s)",
                ],
            )
            m = execute_matrix(spec, base, console, servers=servers)
            results[rate] = {c: [row(p) for p in paths] for c, paths in m.runs.items()}
            if 130 in m.exit_codes.values():
                break
    finally:
        for srv in servers.values():
            srv.stop()
    (out / "disagg.json").write_text(json.dumps(results, indent=1))
    render(results, size, console)
    console.print(f"runs and disagg.json in {out}")
    return 0


def render(results: dict[float, dict[str, list[dict[str, Any]]]], size: Size, c: Console) -> None:
    t = Table(title=f"mixed workload, length scale {size.length_scale:g}, {size.requests} sessions")
    for col in (
        "rate/s",
        "config",
        "ok",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "goodput/s",
        "good %",
        "out tok/s",
        "KV xfer p50 ms",
        "xfer/TTFT",
    ):
        t.add_column(col, justify="right")
    for rate, configs in results.items():
        for name, rows in configs.items():
            for r in rows:
                kv = r.get("kv") or {}
                frac = r["goodput_fraction"]
                t.add_row(
                    f"{rate:g}",
                    name + ("" if r["valid"] else " (invalid)"),
                    f"{r['ok']}/{r['sent']}",
                    _ms(r["ttft_p50"]),
                    _ms(r["ttft_p99"]),
                    _ms(r["itl_p50"]),
                    _ms(r["itl_p99"]),
                    f"{r['goodput'] or 0:.3f}",
                    "-" if frac is None else f"{100 * frac:.0f}",
                    f"{r['out_tok_s'] or 0:.1f}",
                    f"{kv['transfer_ms_p50']:.1f}" if kv else "",
                    f"{100 * kv['share_of_ttft_p50']:.2f}%" if kv else "",
                )
    c.print(t)


if __name__ == "__main__":
    sys.exit(main())
