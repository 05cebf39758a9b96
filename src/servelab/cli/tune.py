"""`servelab tune` (registered by servelab.cli through COMMANDS). No heavy imports at module level."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from servelab.cli.errors import fail


def tune_command(
    run_dir: Annotated[
        Path,
        typer.Argument(
            help="a `servelab bench` run directory: of the embedded engine, or of another "
            "server (vLLM, SGLang, llama.cpp), replayed on its twin"
        ),
    ],
    objective: Annotated[
        str | None,
        typer.Option(
            help="what to improve: goodput (the default where the workload has SLOs), or "
            "a figure such as e2e_p95 (the default without SLOs), ttft_p95@CLASS, "
            "itl_p99, output_tok_s"
        ),
    ] = None,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="rerun the run's planned requests with the chosen setting and as run "
            "(alternating repeats) and report measured vs predicted: on the embedded engine, "
            "or another server relaunched from --server-template",
        ),
    ] = False,
    server_template: Annotated[
        str | None,
        typer.Option(
            help="--verify on another server's run: its launch command with {host}, {port} "
            "and {flags} (also {model}), e.g. "
            "'vllm serve {model} --host {host} --port {port} {flags}'; "
            "default: the template the run was launched from, if servelab recorded one "
            "(with --trust-run-template)"
        ),
    ] = None,
    trust_run_template: Annotated[
        bool,
        typer.Option(
            "--trust-run-template",
            help="--verify without --server-template: run the template the run's manifest "
            "records (printed first); a run directory can come from anyone",
        ),
    ] = False,
    ignore_gates: Annotated[
        bool,
        typer.Option(
            "--ignore-gates",
            help="tune a run the gates refuse (marked invalid, over 5% failed requests, too "
            "few requests per class for the objective, an unflushed prefix cache); their "
            "reasons become notes",
        ),
    ] = False,
    server_model: Annotated[
        str | None,
        typer.Option(help="--server-template's {model} (default: the run's tokenizer)"),
    ] = None,
    health_timeout: Annotated[
        float, typer.Option(help="--verify: seconds a relaunched server has to come up")
    ] = 900.0,
    hardware: Annotated[
        str | None,
        typer.Option(
            help="another server's run: the hardware it ran on (as `servelab calibrate --hardware`), "
            "for its engine's defaults there (default: its CPU build's)"
        ),
    ] = None,
    repeats: Annotated[int, typer.Option(help="--verify: runs of each config")] = 2,
    tolerance: Annotated[
        float,
        typer.Option(help="self-check: how far (share) the replay may stray from the run"),
    ] = 0.15,
    seeds: Annotated[int, typer.Option(help="simulator seeds per candidate")] = 5,
    jobs: Annotated[
        int | None, typer.Option(help="simulation processes (default: one per CPU)")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="--verify: output directory for its runs")
    ] = None,
    html: Annotated[
        Path | None, typer.Option("--html", help="also write the tuning as an HTML page")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print machine-readable JSON")] = False,
) -> None:
    """Predict what each finding's levers would do on this run's own requests, choose one setting, and verify it (--verify)."""
    from rich.console import Console

    from servelab.report.tuning_view import render_tuning, write_tuning_report
    from servelab.rundir import RunDirError
    from servelab.workflows.tuning_loop import TuneSpec, run_tune

    if seeds < 2 or repeats < 1:
        raise fail("--seeds must be >= 2 and --repeats >= 1")
    spec = TuneSpec(
        run_dir,
        objective,
        tolerance,
        seeds,
        jobs,
        verify=verify,
        repeats=repeats,
        out=out,
        server_template=server_template,
        hardware=hardware,
        server_model=server_model,
        health_timeout=health_timeout,
        trust_run_template=trust_run_template,
        ignore_gates=ignore_gates,
    )
    console = Console(quiet=json_out)
    try:
        tuning = run_tune(spec, console)
    except (RunDirError, ValueError, RuntimeError) as e:
        raise fail(str(e)) from None
    if json_out:
        typer.echo(json.dumps(tuning.to_dict(), indent=1, default=str))
    else:
        render_tuning(tuning, Console())
    if html is not None:
        write_tuning_report(tuning, html)
        typer.echo(f"tuning written to {html.resolve()}")


COMMANDS = {"tune": tune_command}
