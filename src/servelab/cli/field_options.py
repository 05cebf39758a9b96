"""The one way a command is declared: a dataclass of flags and one call (as vLLM's
``add_cli_args``).

Each field is one option: its name gives the flag (``max_num_seqs`` -> ``--max-num-seqs``;
a bool gets ``--x/--no-x``), its type and default the option's, and its metadata the
rest: ``help`` (required), and where typer's defaults do not fit ``decls`` (the option's
spellings), ``panel`` (the help panel it is listed in), ``argument`` (a positional
argument instead of an option), ``envvar``, ``show_envvar``, ``show_default``, ``hidden``,
``is_eager`` and ``callback``. A field whose type is itself such a dataclass (options that
several commands share) contributes its fields in its place, and the command rebuilds it.
The flags are declared once, on the record; the command reads the record's attributes.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Sequence
from typing import Annotated, Any, TypeVar

import typer

R = TypeVar("R")
S = TypeVar("S")


def flag(default: Any, help: str, **declared: Any) -> Any:
    """A field of a flags record: its default, its ``--help`` text and how it is declared
    (the metadata keys above). ``default=...`` makes it required."""
    return dataclasses.field(default=default, metadata={"help": help, **declared})


def spec_from_flags(spec: type[S], flags: object, **given: Any) -> S:
    """``spec`` (a dataclass: what a workflow takes) with each field not in ``given`` read
    from the attribute of ``flags`` that has its name: how a command hands its flags on.
    ``given`` holds the fields a flag does not carry as they are (converted, renamed). No
    field falls back on its default: one neither names raises AttributeError."""
    fields = dataclasses.fields(spec)  # type: ignore[arg-type]
    values = {f.name: getattr(flags, f.name) for f in fields if f.name not in given}
    return spec(**values, **given)


def command_from_fields(
    record: type[R], call: Callable[[R], None], panels: Sequence[str] = ()
) -> Callable[..., None]:
    """A command function taking one parameter per (flattened) field of ``record``; it builds
    the record from them and passes it to ``call`` (whose name and docstring it takes, and
    which it keeps as ``.call``).

    ``panels`` orders the help panels (the options of each keep the record's order); a
    panel left out keeps its place of first appearance after them.
    """
    params = _parameters(record)
    rank = {p: i for i, p in enumerate(panels)}
    params.sort(key=lambda p: rank.get(_panel_of(p), len(rank)))
    names = [p.name for p in params]

    def command(**flags: Any) -> None:
        call(_build(record, flags))

    command.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        sorted(params, key=lambda p: p.kind)  # positional arguments before keyword options
    )
    command.__name__ = call.__name__
    command.__doc__ = call.__doc__
    command.call = call  # type: ignore[attr-defined]  # what the layout check measures
    assert len(set(names)) == len(names), f"{record.__name__}: a flag declared twice"
    return command


def _parameters(record: type) -> list[inspect.Parameter]:
    hints = typing.get_type_hints(record)
    params: list[inspect.Parameter] = []
    for f in dataclasses.fields(record):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            params.extend(_parameters(kind))  # type: ignore[arg-type]
            continue
        meta = f.metadata
        shown = {k: meta[k] for k in ("envvar", "show_envvar", "hidden") if k in meta}
        if kind is bool:  # a flag, not a value: no <bool> beside it
            shown["metavar"] = ""
        declare = typer.Argument if meta.get("argument") else typer.Option
        info = declare(
            *meta.get("decls", ()),
            help=meta["help"],
            show_default=meta.get("show_default", True),
            rich_help_panel=meta.get("panel"),
            is_eager=meta.get("is_eager", False),
            callback=meta.get("callback"),
            **shown,
        )
        params.append(
            inspect.Parameter(
                f.name,
                inspect.Parameter.POSITIONAL_OR_KEYWORD
                if meta.get("argument")
                else inspect.Parameter.KEYWORD_ONLY,
                default=f.default,  # ``...``: required
                annotation=Annotated[kind, info],
            )
        )
    return params


def _panel_of(param: inspect.Parameter) -> str | None:
    info = typing.get_args(param.annotation)[1]
    return getattr(info, "rich_help_panel", None)


def _build(record: type[R], flags: dict[str, Any]) -> R:
    hints = typing.get_type_hints(record)
    values = {}
    for f in dataclasses.fields(record):  # type: ignore[arg-type]
        kind = hints[f.name]
        values[f.name] = _build(kind, flags) if dataclasses.is_dataclass(kind) else flags[f.name]
    return record(**values)
