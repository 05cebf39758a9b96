"""`servelab import` (registered by servelab.cli through COMMANDS). No heavy imports at module level."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import typer

from servelab.cli.errors import fail
from servelab.cli.field_options import command_from_fields, flag


@dataclass(frozen=True)
class ImportFlags:
    source: Path = flag(
        ...,
        "another tool's per-request results: GuideLLM's results JSON, a `vllm bench "
        "serve --save-result --save-detailed` JSON, AIPerf's profile_export.jsonl (or its "
        "artifact directory) or vLLM's OpenTelemetry spans as OTLP JSON",
        argument=True,
    )
    out: Path = flag(..., "the run directory to write")
    fmt: str | None = flag(
        None, "guidellm, vllm, aiperf or otel (default: detected)", decls=("--format",)
    )
    server_config: str | None = flag(
        None,
        "the server's launch command or flags, e.g. 'vllm serve M --max-num-seqs 8', "
        "recorded for calibrate and tune (as bench --server-config)",
    )


def import_command(flags: ImportFlags) -> None:
    """Turn another benchmark tool's per-request results into a run directory that diagnose,
    report, calibrate and tune read."""
    from servelab.bench.imports import import_file
    from servelab.bench.imports.imported import LACKS

    f = flags
    try:
        path, imp = import_file(
            f.source,
            f.out,
            fmt=f.fmt,
            command=["servelab", *sys.argv[1:]],
            server_config=f.server_config,
        )
    except (ValueError, OSError) as e:
        raise fail(str(e), "import") from None
    version = f" {imp.version}" if imp.version else ""
    typer.echo(f"imported {len(imp.records)} requests from {imp.tool}{version} into {path}")
    for lack in imp.lacks:
        typer.echo(f"  lacks {LACKS[lack]}")


COMMANDS = {"import": command_from_fields(ImportFlags, import_command)}
