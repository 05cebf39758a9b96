"""`servelab import` (registered by servelab.cli through COMMANDS). No heavy imports at module level."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from servelab.cli.errors import fail


def import_command(
    source: Annotated[
        Path,
        typer.Argument(
            help="another tool's per-request results: GuideLLM's results JSON, a `vllm bench "
            "serve --save-result --save-detailed` JSON, AIPerf's profile_export.jsonl (or its "
            "artifact directory) or vLLM's OpenTelemetry spans as OTLP JSON"
        ),
    ],
    out: Annotated[Path, typer.Option(help="the run directory to write")],
    fmt: Annotated[
        str | None,
        typer.Option("--format", help="guidellm, vllm, aiperf or otel (default: detected)"),
    ] = None,
    server_config: Annotated[
        str | None,
        typer.Option(
            help="the server's launch command or flags, e.g. 'vllm serve M --max-num-seqs 8', "
            "recorded for calibrate and tune (as bench --server-config)"
        ),
    ] = None,
) -> None:
    """Turn another benchmark tool's per-request results into a run directory that diagnose,
    report, calibrate and tune read."""
    from servelab.bench.imports import import_file
    from servelab.bench.imports.imported import LACKS

    try:
        path, imp = import_file(
            source, out, fmt=fmt, command=["servelab", *sys.argv[1:]], server_config=server_config
        )
    except (ValueError, OSError) as e:
        raise fail(str(e), "import") from None
    version = f" {imp.version}" if imp.version else ""
    typer.echo(f"imported {len(imp.records)} requests from {imp.tool}{version} into {path}")
    for lack in imp.lacks:
        typer.echo(f"  lacks {LACKS[lack]}")


COMMANDS = {"import": import_command}
