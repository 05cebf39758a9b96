"""`servelab tune` (registered by servelab.cli through COMMANDS). No heavy imports at module level."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import typer

from servelab.cli.errors import fail
from servelab.cli.field_options import command_from_fields, flag, spec_from_flags


@dataclass(frozen=True)
class TuneFlags:
    run_dir: Path = flag(
        ...,
        "a `servelab bench` run directory: of the embedded engine, or of another "
        "server (vLLM, SGLang, llama.cpp), replayed on its twin",
        argument=True,
    )
    objective: str | None = flag(
        None,
        "what to improve: goodput (the default where the workload has SLOs), or "
        "a figure such as e2e_p95 (the default without SLOs), ttft_p95@CLASS, "
        "itl_p99, output_tok_s",
    )
    verify: bool = flag(
        False,
        "measure the config as run and the top three settings on fresh requests of the "
        "run's workload (alternating, paired within each repeat) and report measured vs "
        "predicted changes, the MAPE and whether the top-1 pays: on the embedded engine, "
        "or another server relaunched from --server-template",
        decls=("--verify",),
    )
    server_template: str | None = flag(
        None,
        "--verify on another server's run: its launch command with {host}, {port} "
        "and {flags} (also {model}), e.g. "
        "'vllm serve {model} --host {host} --port {port} {flags}'; "
        "default: the template the run was launched from, if servelab recorded one "
        "(with --trust-run-template)",
    )
    trust_run_template: bool = flag(
        False,
        "--verify without --server-template: run the template the run's manifest "
        "records (printed first); a run directory can come from anyone",
        decls=("--trust-run-template",),
    )
    ignore_gates: bool = flag(
        False,
        "tune a run the gates refuse (marked invalid, over 5% failed requests, too "
        "few requests per class for the objective, an unflushed prefix cache); their "
        "reasons become notes",
        decls=("--ignore-gates",),
    )
    server_model: str | None = flag(
        None, "--server-template's {model} (default: the run's tokenizer)"
    )
    health_timeout: float = flag(900.0, "--verify: seconds a relaunched server has to come up")
    hardware: str | None = flag(
        None,
        "another server's run: the hardware it ran on (as `servelab calibrate --hardware`), "
        "for its engine's defaults there (default: its CPU build's)",
    )
    repeats: int = flag(2, "--verify: runs of each config, each on fresh requests (at least 2)")
    min_uplift: float = flag(
        0.05,
        "--verify: the top-1's measured gain on the objective (share) below which the "
        "answer is to keep the config as run",
    )
    calibration: Path | None = flag(
        None,
        "another server's run: predict from this twin file (`servelab calibrate`, e.g. on "
        "two launches) instead of a twin fitted to the run alone",
    )
    server_config: str | None = flag(
        None,
        "another server's run: the launch command or flags it ran with, where the run did "
        "not record them (as `servelab bench --server-config`)",
    )
    tolerance: float = flag(
        0.15, "self-check: how far (share) the replay may stray outside the measured CI"
    )
    seeds: int = flag(5, "simulator seeds per candidate")
    jobs: int | None = flag(None, "simulation processes (default: one per CPU)")
    out: Path | None = flag(None, "--verify: output directory for its runs")
    html: Path | None = flag(None, "also write the tuning as an HTML page", decls=("--html",))
    json_out: bool = flag(False, "print machine-readable JSON", decls=("--json",))


def tune_command(flags: TuneFlags) -> None:
    """Predict what each finding's levers would do on this run's own requests, choose one setting, and verify it (--verify)."""
    from rich.console import Console

    from servelab.report.tuning_view import render_tuning, write_tuning_report
    from servelab.rundir import RunDirError
    from servelab.workflows.tuning_loop import TuneSpec, run_tune

    f = flags
    if f.seeds < 2 or f.repeats < 2:
        raise fail("--seeds and --repeats must be >= 2 (--verify's tests pair arms by repeat)")
    if not 0 <= f.min_uplift < 1:
        raise fail("--min-uplift is a share of the objective: 0 <= it < 1, e.g. 0.05")
    # the flags carry every field of the spec but the number of candidates --verify measures
    spec = spec_from_flags(TuneSpec, f, top=TuneSpec.top)
    console = Console(quiet=f.json_out)
    try:
        tuning = run_tune(spec, console)
    except (RunDirError, ValueError, RuntimeError) as e:
        raise fail(str(e)) from None
    if f.json_out:
        typer.echo(json.dumps(tuning.to_dict(), indent=1, default=str))
    else:
        render_tuning(tuning, Console())
    if f.html is not None:
        write_tuning_report(tuning, f.html)
        typer.echo(f"tuning written to {f.html.resolve()}")


COMMANDS = {"tune": command_from_fields(TuneFlags, tune_command)}
