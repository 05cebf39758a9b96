"""A typer command whose options are a dataclass's fields (as vLLM's ``add_cli_args``).

Each field is one option: its name gives the flag (``max_num_seqs`` -> ``--max-num-seqs``;
a bool gets ``--x/--no-x``), its type and default the option's, and its metadata the
rest: ``help`` (required), and where typer's defaults do not fit ``decls`` (the option's
spellings), ``envvar`` and ``show_default``. The flags are declared once, on the record.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

R = TypeVar("R")


def command_from_fields(record: type[R], call: Callable[[R], None]) -> Callable[..., None]:
    """A command function taking one keyword option per field of ``record``; it builds the
    record from them and passes it to ``call`` (whose name and docstring it takes)."""
    hints = typing.get_type_hints(record)
    params = []
    for f in dataclasses.fields(record):  # type: ignore[arg-type]
        meta = f.metadata
        option = typer.Option(
            *meta.get("decls", ()),
            help=meta["help"],
            envvar=meta.get("envvar"),
            show_default=meta.get("show_default", True),
        )
        params.append(
            inspect.Parameter(
                f.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=f.default,
                annotation=Annotated[hints[f.name], option],
            )
        )

    def command(**flags: Any) -> None:
        call(record(**flags))

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__name__ = call.__name__
    command.__doc__ = call.__doc__
    return command
