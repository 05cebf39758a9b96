"""The `servelab` command: every typer command lives in this package, one module per group.

Each command is declared one way: a frozen dataclass of flags (each field one option, with
its help) and one function taking it, joined by ``field_options.command_from_fields``; each
command module lists its commands in ``COMMANDS`` (name -> command) and they are
registered here. Command modules import nothing
heavy at module level (no torch), so that `servelab bench` never loads the engine.

Ending the process without freeing what a command built (``held_to_exit``): a
whole-trace `servelab sim` ends holding tens of millions of objects (the run's records,
timelines and steps, the trace's prompts). Freeing them one at a time as the command's
frames unwind, then the interpreter's own teardown, is pure cost once every file is
written and closed (docs/design/sim.md, "Speed: the whole command").

``main`` (the process's entry point) runs the command line inside ``held_to_exit``; while
it runs, ``held()`` is a list a command puts such objects in. When the command line ends
with status 0 and something is held, ``held_to_exit`` runs the atexit handlers, flushes
stdout and stderr and ends the process (``os._exit``) instead of unwinding; any other
ending unwinds as usual. Threads are not waited for: a command that holds objects joins
its own first. Outside ``main`` (typer's CliRunner in tests, a library call) ``held()`` is
None and nothing changes.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NoReturn

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


_held: list[object] | None = None


def held() -> list[object] | None:
    """The list whose objects outlive the command to the end of the process, while
    ``held_to_exit`` runs; None otherwise."""
    return _held


@contextmanager
def held_to_exit() -> Iterator[None]:
    """Run the command line inside: what it put in ``held()`` is never freed if it ends
    with status 0 (the process ends there); otherwise it unwinds as usual."""
    global _held
    _held = []
    try:
        try:
            yield
        except SystemExit as e:
            if _held and e.code in (0, None):
                _end_process()
            raise
        if _held:
            _end_process()
    finally:
        _held = None


def _end_process() -> NoReturn:
    """Exit with status 0 as the interpreter would, less its teardown: the atexit handlers
    run and stdout and stderr are flushed (status 120 when that fails, as Python's own)."""
    atexit._run_exitfuncs()
    status = 0
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            status = 120
    os._exit(status)


def main() -> None:
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
