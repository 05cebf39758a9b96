"""`servelab export RUN --format csv|parquet`: a run's requests as one table (registered by
servelab.cli through COMMANDS). The table is ``analyze.requests_table``'s."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import typer

from servelab.cli.errors import fail
from servelab.cli.field_options import command_from_fields, flag


@dataclass(frozen=True)
class ExportFlags:
    run_dir: Path = flag(..., "a run directory written by `servelab bench`", argument=True)
    fmt: str = flag("csv", "csv, or parquet (needs pyarrow)", decls=("--format",))
    out: Path | None = flag(
        None, "output file (default: requests.csv or requests.parquet in the run)"
    )


def export_command(flags: ExportFlags) -> None:
    """Write a run's requests as one table (one row per request, latencies in seconds)."""
    from servelab.analyze.requests_table import (
        MissingPyarrow,
        request_rows,
        write_csv,
        write_parquet,
    )
    from servelab.rundir import RunDirError, load_run

    run_dir, fmt = flags.run_dir, flags.fmt
    if fmt not in ("csv", "parquet"):
        raise fail(f"--format {fmt!r}: give csv or parquet", "export")
    try:
        run = load_run(run_dir)
    except RunDirError as e:
        raise fail(str(e), "export") from None
    path = flags.out or run_dir / f"requests.{fmt}"
    rows = request_rows(run)
    try:
        (write_csv if fmt == "csv" else write_parquet)(rows, path)
    except MissingPyarrow as e:
        raise fail(str(e), "export") from None
    typer.echo(f"wrote {len(rows)} requests to {path}")


COMMANDS = {"export": command_from_fields(ExportFlags, export_command)}
