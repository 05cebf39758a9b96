"""The `servelab` command: every typer command lives in this package, one module per group.

Each command module holds its commands as plain functions and lists them in ``COMMANDS``
(name -> function); they are registered here, in one way. Command modules import nothing
heavy at module level (no torch), so that `servelab bench` never loads the engine.
"""

from __future__ import annotations

import typer

from servelab import __version__

app = typer.Typer(
    name="servelab",
    help="See, measure and tune the two phases of LLM inference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register_all() -> None:
    from servelab.cli import analyze, bench, export_hf, generate, runexport, serve, sim, tune

    for module in (generate, export_hf, serve, bench, analyze, sim, tune, runexport):
        for name, command in module.COMMANDS.items():
            app.command(name)(command)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_print_version, help="Print the version."
    ),
) -> None:
    """See, measure and tune the two phases of LLM inference."""


@app.command()
def version() -> None:
    """Print servelab's version."""
    typer.echo(__version__)


_register_all()


def main() -> None:
    try:
        app()
    except ModuleNotFoundError as e:  # a module an extra installs: one line, exit 2
        from servelab.cli.errors import fail
        from servelab.cli.extras import missing_extra_message

        message = missing_extra_message(e)
        if message is None:
            raise
        raise SystemExit(fail(message).exit_code) from None


if __name__ == "__main__":
    main()
