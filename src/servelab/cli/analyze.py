"""`servelab diagnose`, `compare`, `report` and `demo` (registered by servelab.cli).

No heavy imports at module level: each command imports what it needs when it runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from servelab.cli.errors import fail
from servelab.cli.extras import require_engine
from servelab.cli.field_options import command_from_fields, flag

if TYPE_CHECKING:
    from servelab.rundir import Run


_JSON_HELP = "print machine-readable JSON"


def _load(paths: list[Path]) -> list[Run]:
    from servelab.rundir import RunDirError, load_run

    try:
        return [load_run(p) for p in paths]
    except RunDirError as e:
        raise fail(str(e)) from None


@dataclass(frozen=True)
class DiagnoseFlags:
    run_dir: Path = flag(..., "a run directory written by `servelab bench`", argument=True)
    json_out: bool = flag(False, _JSON_HELP, decls=("--json",))


def diagnose(flags: DiagnoseFlags) -> None:
    """Explain a run's latencies: where TTFT went, what caused ITL stalls, what to change."""
    from rich.console import Console

    from servelab.analyze.diagnosis.diagnose import diagnose as run_diagnosis
    from servelab.report.terminal import render_diagnosis

    (run,) = _load([flags.run_dir])
    d = run_diagnosis(run)
    if flags.json_out:
        typer.echo(json.dumps(d.to_dict(), indent=1, default=str))
    else:
        render_diagnosis(d, Console())


@dataclass(frozen=True)
class CompareFlags:
    run_dirs: list[Path] = flag(
        ..., "two or more run directories; the first is the baseline", argument=True
    )
    json_out: bool = flag(False, _JSON_HELP, decls=("--json",))
    alpha: float = flag(0.05, "significance level (false discovery rate)")
    fail_on: str | None = flag(
        None,
        "exit 1 when a run regressed beyond a threshold AND significantly, e.g. "
        "'ttft.p99:+10%,goodput:-5%' (docs/metrics.md, 'Gating a pipeline')",
        decls=("--fail-on",),
    )


def compare(flags: CompareFlags) -> None:
    """Compare runs metric by metric, marking which differences are significant and which are noise."""
    from rich.console import Console

    from servelab.analyze.compare import compare as run_compare
    from servelab.analyze.gate import gate, parse_rules
    from servelab.report.terminal import render_comparison

    run_dirs, alpha, json_out = flags.run_dirs, flags.alpha, flags.json_out
    if len(run_dirs) < 2:
        raise fail("compare needs at least two run directories (the first is the baseline)")
    if not 0 < alpha < 1:
        raise fail(f"--alpha must be between 0 and 1, got {alpha}")
    try:
        rules = parse_rules(flags.fail_on) if flags.fail_on is not None else None
    except ValueError as e:
        raise fail(f"--fail-on {e}", "compare") from None
    runs = _load(run_dirs)
    c = run_compare(runs, alpha=alpha)
    if json_out:
        typer.echo(json.dumps(c.to_dict(), indent=1, default=str))
    else:
        render_comparison(c, Console())
    if rules is not None:
        verdicts = gate(runs, c, rules, alpha=alpha)
        for v in verdicts:
            typer.echo(f"{'FAIL' if v.failed else 'pass'} {v.label}: {v.reason}", err=json_out)
        if any(v.failed for v in verdicts):
            raise typer.Exit(1)


@dataclass(frozen=True)
class ReportFlags:
    run_dirs: list[Path] = flag(..., "one or more run directories", argument=True)
    html: Path | None = flag(
        None, "output file (default: report.html in the first run directory)", decls=("--html",)
    )
    trace_json: Path | None = flag(
        None,
        "also write the first run's request phases and engine steps as a Chrome "
        "Trace Event file (open it in ui.perfetto.dev or chrome://tracing)",
        decls=("--trace-json",),
    )


def report(flags: ReportFlags) -> None:
    """Write one self-contained HTML report (charts work offline) for one or more runs."""
    from servelab.analyze.compare import compare as run_compare
    from servelab.analyze.diagnosis.diagnose import diagnose as run_diagnosis
    from servelab.report.html import write_report

    runs = _load(flags.run_dirs)
    out = flags.html or (flags.run_dirs[0] / "report.html")
    comparison = run_compare(runs) if len(runs) > 1 else None
    diagnoses = [run_diagnosis(r) for r in runs]
    write_report(runs, diagnoses, out, comparison)
    typer.echo(f"report written to {out.resolve()}")
    if flags.trace_json is not None:
        from servelab.report.trace import chrome_trace

        d = diagnoses[0]
        trace = chrome_trace(runs[0], d.attribution.stalls if d.attribution else [])
        flags.trace_json.write_text(json.dumps(trace))
        typer.echo(f"trace written to {flags.trace_json.resolve()} (open it in ui.perfetto.dev)")


@dataclass(frozen=True)
class DemoFlags:
    quick: bool = flag(False, "a reduced size for CI (a couple of minutes)", decls=("--quick",))
    out: Path | None = flag(None, "output directory (default: runs/<time>-demo)")
    seed: int = flag(1, "seed of the planned requests")
    verbose: bool = flag(
        False, "every sub-run's tables and each question's findings", decls=("--verbose",)
    )


def demo(flags: DemoFlags) -> None:
    """The main job: six questions (RAG TTFT, chunked prefill, priorities, decode ITL, speculative decoding, disaggregation), each answered by one comparison."""
    require_engine("demo")
    from servelab.workflows.demo import run_demo

    try:
        result = run_demo(quick=flags.quick, out=flags.out, seed=flags.seed, verbose=flags.verbose)
    except (ValueError, RuntimeError) as e:
        raise fail(str(e)) from None
    if result.interrupted:
        raise typer.Exit(130)
    if result.report is None:
        raise fail("no run finished, so there is no report; see the output above")


COMMANDS = {
    "diagnose": command_from_fields(DiagnoseFlags, diagnose),
    "compare": command_from_fields(CompareFlags, compare),
    "report": command_from_fields(ReportFlags, report),
    "demo": command_from_fields(DemoFlags, demo),
}
