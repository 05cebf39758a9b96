"""`servelab export RUN --format csv|parquet`: a run's requests as one table (registered by
servelab.cli through COMMANDS). The table is ``analyze.requests_table``'s."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from servelab.cli.errors import fail


def export_command(
    run_dir: Annotated[Path, typer.Argument(help="a run directory written by `servelab bench`")],
    fmt: Annotated[str, typer.Option("--format", help="csv, or parquet (needs pyarrow)")] = "csv",
    out: Annotated[
        Path | None,
        typer.Option(help="output file (default: requests.csv or requests.parquet in the run)"),
    ] = None,
) -> None:
    """Write a run's requests as one table (one row per request, latencies in seconds)."""
    from servelab.analyze.requests_table import (
        MissingPyarrow,
        request_rows,
        write_csv,
        write_parquet,
    )
    from servelab.rundir import RunDirError, load_run

    if fmt not in ("csv", "parquet"):
        raise fail(f"--format {fmt!r}: give csv or parquet", "export")
    try:
        run = load_run(run_dir)
    except RunDirError as e:
        raise fail(str(e), "export") from None
    path = out or run_dir / f"requests.{fmt}"
    rows = request_rows(run)
    try:
        (write_csv if fmt == "csv" else write_parquet)(rows, path)
    except MissingPyarrow as e:
        raise fail(str(e), "export") from None
    typer.echo(f"wrote {len(rows)} requests to {path}")


COMMANDS = {"export": export_command}
