"""The `servelab` command: every typer command lives in this package, one module per group.

Each command is declared one way: a frozen dataclass of flags (each field one option, with
its help) and one function taking it, joined by ``field_options.command_from_fields``; each
command module lists its commands in ``COMMANDS`` (name -> command) and they are
registered here. Command modules import nothing
heavy at module level (no torch), so that `servelab bench` never loads the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import typer

from servelab import __version__
from servelab.cli.field_options import command_from_fields, flag

app = typer.Typer(
    name="servelab",
    help="See, measure and tune the two phases of LLM inference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register_all() -> None:
    from servelab.cli import (
        analyze,
        bench,
        export_hf,
        generate,
        imports,
        runexport,
        serve,
        sim,
        sim_inputs,
        tune,
    )

    for module in (
        generate,
        export_hf,
        serve,
        bench,
        analyze,
        sim,
        sim_inputs,
        tune,
        runexport,
        imports,
    ):
        for name, command in module.COMMANDS.items():
            app.command(name)(command)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(__version__)
        raise typer.Exit()


@dataclass(frozen=True)
class RootFlags:
    version: bool = flag(
        False, "Print the version.", decls=("--version",), is_eager=True, callback=_print_version
    )


def _root(flags: RootFlags) -> None:
    """See, measure and tune the two phases of LLM inference."""


@dataclass(frozen=True)
class VersionFlags:
    """`servelab version` takes no flags."""


def version(flags: VersionFlags) -> None:
    """Print servelab's version."""
    typer.echo(__version__)


app.callback()(command_from_fields(RootFlags, _root))
app.command("version")(command_from_fields(VersionFlags, version))


_register_all()


def main() -> None:
    from servelab.cli.process_exit import held_to_exit

    with held_to_exit():  # a command's held objects are never freed (see there)
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
