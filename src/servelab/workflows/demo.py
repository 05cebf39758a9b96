"""`servelab demo`: the main job, end to end on the embedded engine.

1. start the embedded engine (two `servelab serve` processes: the demo's default config
   with chunked prefill, and the same with chunked prefill off, for step 3);
2. run the `rag`, `agent` and `mixed` workloads, each as a two-stage sweep (a light and a
   heavy load) against the default server;
3. compare chunked prefill on vs off on the `mixed` load (`bench.matrix`, interleaved);
4. print each run's summary and findings, and the comparison;
5. write one HTML report of it all;
6. print where it is.

Sizes are set for a 2-core CPU: the full demo aims at under 10 minutes, ``--quick`` at a
couple of minutes (CI). Both servers start once and are stopped at the end, whatever
happens in between.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from rich.console import Console

from servelab.analyze.diagnose import Diagnosis, diagnose
from servelab.analyze.summary import run_summary
from servelab.bench.plan import LoadSpec
from servelab.bench.run import DEFAULT_MODEL, BenchOptions, run_bench
from servelab.report.html import write_report
from servelab.report.terminal import render_comparison, render_summary
from servelab.rundir import Run, load_run
from servelab.workflows.matrix import (
    MatrixConfig,
    MatrixResult,
    MatrixSpec,
    execute_matrix,
    has_records,
    record_server,
    start_servers,
)

# The demo's engine: a 256-token chunk budget makes chunking visible with ~1k-token
# prompts; a 1 GB KV pool is plenty for these loads and halves the memory of two servers.
CHUNKED = "--max-num-batched-tokens 256 --kv-cache-memory 1G"
UNCHUNKED = "--no-enable-chunked-prefill --kv-cache-memory 1G"
WORKLOADS = ("rag", "agent", "mixed")
INTERRUPTED = 130


@dataclass(frozen=True)
class DemoSize:
    """How much to run. Rates are sessions/s for (light, heavy); lengths are scaled."""

    requests: int  # per load stage (sessions)
    stage_seconds: float  # no sends after this long in a stage
    rates: dict[str, tuple[float, float]]
    length_scale: dict[str, float]
    matrix_requests: int
    matrix_rate: float
    repeats: int
    budget: str  # what the user is told to expect
    budget_s: float  # past 60% of it before step 3, the comparison runs one repeat only


FULL = DemoSize(
    requests=8,
    stage_seconds=35.0,
    rates={"rag": (0.1, 0.25), "agent": (0.05, 0.2), "mixed": (0.15, 0.5)},
    length_scale={"rag": 0.5, "agent": 0.25, "mixed": 0.5},
    matrix_requests=8,
    matrix_rate=0.4,
    repeats=2,
    budget="under 10 minutes on a 2-core CPU",
    budget_s=600.0,
)
QUICK = DemoSize(
    requests=3,
    stage_seconds=10.0,
    rates={"rag": (0.4, 1.5), "agent": (0.4, 1.5), "mixed": (0.4, 1.5)},
    length_scale={"rag": 0.15, "agent": 0.1, "mixed": 0.15},
    matrix_requests=4,
    matrix_rate=1.0,
    repeats=1,
    budget="a couple of minutes",
    budget_s=180.0,
)


@dataclass
class DemoResult:
    out: Path
    report: Path | None
    runs: list[Run]
    diagnoses: list[Diagnosis]
    matrix: MatrixResult | None
    interrupted: bool = False


def _sweep_opts(wl: str, size: DemoSize, url: str, out: Path) -> BenchOptions:
    low, high = size.rates[wl]
    load = LoadSpec(
        rate=low,
        requests=size.requests,
        duration=size.stage_seconds,
        length_scale=size.length_scale[wl],
    )
    return BenchOptions(
        url=url,
        tokenizer=DEFAULT_MODEL,
        workload=wl,
        load=load,
        sweep=("rate", [low, high]),
        out=out / wl,
        command=["servelab", "demo", f"({wl} at {low:g} and {high:g} sessions/s)"],
    )


def _matrix_opts(size: DemoSize, out: Path) -> BenchOptions:
    load = LoadSpec(
        rate=size.matrix_rate,
        requests=size.matrix_requests,
        duration=size.stage_seconds,
        length_scale=size.length_scale["mixed"],
    )
    return BenchOptions(
        tokenizer=DEFAULT_MODEL,
        workload="mixed",
        load=load,
        out=out / "chunked-prefill",
        seed=1,
        command=["servelab", "demo", "(chunked prefill on vs off, mixed)"],
    )


def run_demo(
    quick: bool = False,
    out: Path | None = None,
    console: Console | None = None,
    size: DemoSize | None = None,
) -> DemoResult:
    """Run the whole demo (``size`` overrides FULL/QUICK); raises RuntimeError when a
    server cannot start."""
    console = console or Console()
    size = size or (QUICK if quick else FULL)
    out = out or Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-demo{'-quick' if quick else ''}"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    console.rule("[bold]servelab demo" + (" --quick" if quick else ""))
    console.print(
        f"Workloads {', '.join(WORKLOADS)} at two loads each, then chunked prefill on vs off on "
        f"'mixed'; expect {size.budget}. Everything lands in {out}."
    )
    console.rule("step 1: start the embedded engine")
    servers = start_servers({"chunked": CHUNKED, "unchunked": UNCHUNKED}, out, console=console)
    console.print(f"engine ready in {time.monotonic() - t0:.0f} s")
    dirs: list[Path] = []
    matrix = None
    interrupted = False
    try:
        for i, wl in enumerate(WORKLOADS, 1):
            console.rule(f"step 2.{i}: {wl} at two loads")
            opts = _sweep_opts(wl, size, servers["chunked"].url, out)
            code = run_bench(opts, console)
            if has_records(out / wl):
                record_server(out / wl, servers["chunked"])
                dirs.append(out / wl)
            if code == INTERRUPTED:
                interrupted = True
                break
        if not interrupted:
            console.rule("step 3: chunked prefill on vs off (mixed)")
            repeats = size.repeats
            if repeats > 1 and time.monotonic() - t0 > 0.6 * size.budget_s:
                repeats = 1
                console.print(
                    "[yellow]this machine is slower than the demo's sizes assume: "
                    "one repeat per config instead of "
                    f"{size.repeats} to stay near {size.budget}[/]"
                )
            spec = MatrixSpec(
                [MatrixConfig("chunked", CHUNKED), MatrixConfig("unchunked", UNCHUNKED)],
                repeats,
            )
            matrix = execute_matrix(spec, _matrix_opts(size, out), console, servers=servers)
            interrupted = INTERRUPTED in matrix.exit_codes.values()
    finally:
        with console.status("stopping the engine ..."):
            for srv in servers.values():
                srv.stop()
    return _conclude(out, dirs, matrix, interrupted, console, t0)


def _conclude(
    out: Path,
    dirs: list[Path],
    matrix: MatrixResult | None,
    interrupted: bool,
    console: Console,
    t0: float,
) -> DemoResult:
    console.rule("step 4: summary and findings")
    runs = [load_run(d) for d in dirs]
    groups = matrix.groups if matrix else []
    all_runs = runs + [r for g in groups for r in g]
    diagnoses = []
    with console.status("diagnosing ..."):
        diagnoses = [diagnose(r) for r in all_runs]
    for run, d in zip(runs, diagnoses):
        render_summary(run.name, run_summary(run), console)
        if not d.findings:
            console.print("  [green]no findings[/]")
        for f in d.findings:
            console.print(f"  [yellow]> {f.title}[/] [dim]({f.confidence_label})[/]: {f.summary}")
    if matrix is not None and matrix.comparison is not None:
        render_comparison(matrix.comparison, console, scopes=("overall",), stats=("p50", "p99"))
    report = None
    if all_runs:
        console.rule("step 5: the HTML report")
        with console.status("writing the report ..."):
            report = write_report(
                all_runs,
                diagnoses,
                out / "report.html",
                matrix.comparison if matrix else None,
                title="servelab demo: rag, agent, mixed; chunked prefill on vs off",
                groups=groups or None,
            )
    console.rule("step 6: where it is")
    if report is not None:
        console.print(f"[bold]report: {report.resolve()}[/]")
    console.print(f"run directories under {out.resolve()} ({time.monotonic() - t0:.0f} s in all)")
    if interrupted:
        console.print("[yellow]interrupted: the report covers what ran[/]")
    return DemoResult(out, report, all_runs, diagnoses, matrix, interrupted)
