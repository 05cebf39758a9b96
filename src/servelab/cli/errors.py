"""How every command reports a bad flag or file: one line that says what to do, exit 2, no
traceback; the one parser of duration flags; the note on the old ``--engine-args`` spelling."""

from __future__ import annotations

import typer

from servelab.units import parse_duration


def fail(message: str, command: str | None = None) -> typer.Exit:
    """Print ``[servelab COMMAND: ]error: message`` to stderr; raise the returned Exit (2)."""
    prefix = f"servelab {command}: " if command else ""
    typer.secho(f"{prefix}error: {message}", fg="red", err=True)
    return typer.Exit(2)


def bad_flag(flag: str, message: str) -> typer.BadParameter:
    """A usage error naming ``flag`` (typer prints it with the command's usage line)."""
    return typer.BadParameter(message, param_hint=f"'{flag}'")


def seconds(flag: str, text: str | None) -> float | None:
    """``"90"``, ``"90s"``, ``"1.5min"`` -> seconds (a bare number is seconds); None stays None."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return parse_duration(text, what=flag)
    except ValueError as e:
        raise bad_flag(flag, str(e)) from None


def note_old_spelling(engine_args: str | None) -> None:
    """One line on stderr when ``--engine-args`` uses the old ``key=value`` spelling."""
    from servelab.sim.engine_args import respell

    try:
        new = respell(engine_args)
    except ValueError:
        return  # the command reports the bad setting itself
    if new is not None:
        typer.echo(f"note: key=value is the old spelling; write --engine-args {new!r}", err=True)
