"""How long a user waits for the whole commands on a long replay: `servelab sim` of the Azure
conversational trace on a simulated H200 serving Llama-3.1-8B, then `servelab diagnose` and
`servelab report --html` of the run it wrote, each timed as a subprocess.

    .venv/bin/python -m benchmarks.analyze.analyze_speed [--requests 19366,200000] [--out DIR]
                                                 [--commands sim,diagnose,report]

Sizes above the trace's 19,366 requests replay it again and again, each copy shifted by the
trace's span plus its mean gap, so a 200,000-request run is ten hours of the same traffic.
Prints, per command and size, wall time, CPU time (user + system: the machine is shared, so
wall time includes waiting for a core), peak RSS (the child's own ``ru_maxrss``) and the size
of what it wrote. Targets on the 19,366-request run: sim <= 10 s, diagnose <= 10 s, report
<= 15 s of wall time, each under 1 GB.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from servelab.bench.workloads.traces import load_trace

TRACE = "azure-2023-conv"  # the named trace the package ships: 19,366 requests, one hour
SIM = ["--hardware", "h200", "--model", "llama-3.1-8b", "--no-steps"]
TARGETS = {"sim": (10.0, 1024.0), "diagnose": (10.0, 1024.0), "report": (15.0, 1024.0)}


def repeated_trace(n: int, path: Path) -> Path:
    """An Azure CSV of ``n`` requests: the shipped trace repeated, each copy shifted by the
    span plus the mean gap between requests."""
    rows, _ = load_trace(TRACE)
    span = rows[-1].time - rows[0].time
    period = span + span / (len(rows) - 1)
    t0 = dt.datetime(2023, 11, 16, tzinfo=dt.timezone.utc).timestamp()
    with path.open("w") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for i in range(n):
            row = rows[i % len(rows)]
            t = dt.datetime.fromtimestamp(
                t0 + row.time + (i // len(rows)) * period, dt.timezone.utc
            )
            f.write(f"{t.isoformat()},{row.input_tokens},{row.output_tokens}\n")
    return path


def timed(cmd: list[str]) -> tuple[float, float, float]:
    """Run ``cmd`` with its output discarded; (wall s, CPU s, peak RSS MiB) of that child."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err.decode()[-3000:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", default="19366,200000", help="comma-separated run sizes")
    ap.add_argument("--out", help="where the runs go (default: a temporary directory)")
    ap.add_argument("--commands", default="sim,diagnose,report")
    args = ap.parse_args()
    sizes = [int(x) for x in args.requests.split(",")]
    commands = args.commands.split(",")
    out = Path(args.out or tempfile.mkdtemp(prefix="analyze_speed-"))
    out.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "servelab.cli"]
    rows = []
    for n in sizes:
        run = out / f"azure-{n}"
        trace = TRACE
        if n != 19_366:
            trace = str(repeated_trace(n, out / f"azure-{n}.csv"))
        html = out / f"azure-{n}.html"
        argv = {
            "sim": [*cli, "sim", *SIM, "--trace", trace, "--out", str(run)],
            "diagnose": [*cli, "diagnose", str(run)],
            "report": [*cli, "report", str(run), "--html", str(html)],
        }
        if "sim" in commands and run.exists():
            sys.exit(f"{run} exists: give another --out, or leave sim out of --commands")
        for name in commands:
            wall, cpu, rss = timed(argv[name])
            size = {
                "sim": sum(f.stat().st_size for f in run.iterdir()),
                "diagnose": 0,
                "report": html.stat().st_size if html.exists() else 0,
            }[name]
            rows.append((name, n, wall, cpu, rss, size))
            print(f"{name} {n}: {wall:.1f} s wall, {cpu:.1f} s CPU, {rss:.0f} MiB", flush=True)
    print(f"\nruns in {out}\n")
    print(
        f"{'command':<10}{'requests':>10}{'wall s':>9}{'CPU s':>8}{'peak MiB':>10}{'wrote MB':>10}"
    )
    for name, n, wall, cpu, rss, size in rows:
        target = ""
        if n == 19_366:
            t_wall, t_rss = TARGETS[name]
            target = "  ok" if wall <= t_wall and rss < t_rss else f"  target {t_wall:g} s, 1 GB"
        wrote = f"{size / 1e6:.1f}" if size else "-"
        print(f"{name:<10}{n:>10,}{wall:>9.1f}{cpu:>8.1f}{rss:>10.0f}{wrote:>10}{target}")


if __name__ == "__main__":
    main()
