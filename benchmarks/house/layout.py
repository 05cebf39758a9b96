"""Is the house readable? For every `servelab` command: the lines of the file it is declared
in, the lines of its body and its parameters; for every package folder: how many modules sit
side by side in it. Exits 1, naming them, when a ``cli/*.py`` file is over 300 lines, a
command's body over 40 lines, or a folder holds more than 16 modules (``__init__.py`` not
counted).

    python -m benchmarks.house.layout
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import servelab

MAX_CLI_FILE = 300
MAX_BODY = 40
MAX_MODULES = 16
PACKAGE = Path(servelab.__file__).parent


@dataclass(frozen=True)
class Command:
    name: str
    file: Path
    file_lines: int
    body_lines: int
    params: int


def body_lines(fn: Callable[..., Any]) -> int:
    """The lines of ``fn``'s body: from its first statement after the docstring to its end."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    node = tree.body[0]
    assert isinstance(node, ast.FunctionDef)
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    if not body:
        return 0
    return (body[-1].end_lineno or body[-1].lineno) - body[0].lineno + 1


def commands() -> list[Command]:
    """Every registered command (and the root's options), measured on the function its
    flags record is passed to."""
    from servelab.cli import app

    found = [("(root)", app.registered_callback.callback if app.registered_callback else None)]
    found += [(c.name or "", c.callback) for c in app.registered_commands]
    out = []
    for name, command in found:
        if command is None:
            continue
        call = getattr(command, "call", command)
        file = Path(inspect.getfile(call))
        out.append(
            Command(
                name=name,
                file=file,
                file_lines=len(file.read_text().splitlines()),
                body_lines=body_lines(call),
                params=len(inspect.signature(command).parameters),
            )
        )
    return out


def module_counts() -> dict[str, int]:
    """Package folder (relative to ``servelab``'s parent) -> its modules, ``__init__`` out."""
    counts = {}
    for init in sorted(PACKAGE.rglob("__init__.py")):
        folder = init.parent
        counts[str(folder.relative_to(PACKAGE.parent))] = sum(
            1 for p in folder.glob("*.py") if p.name != "__init__.py"
        )
    return counts


def problems(cmds: list[Command], counts: dict[str, int]) -> list[str]:
    """What breaks the limits, one line each."""
    cli = PACKAGE / "cli"
    found = [
        f"{p.relative_to(PACKAGE.parent)}: {n} lines (> {MAX_CLI_FILE})"
        for p in sorted(cli.glob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_CLI_FILE
    ]
    found += [
        f"servelab {c.name}: a body of {c.body_lines} lines (> {MAX_BODY})"
        for c in cmds
        if c.body_lines > MAX_BODY
    ]
    found += [
        f"{folder}: {n} modules side by side (> {MAX_MODULES})"
        for folder, n in counts.items()
        if n > MAX_MODULES
    ]
    return found


def main() -> int:
    cmds = commands()
    counts = module_counts()
    print(f"{'command':<14} {'file':<28} {'lines':>5} {'body':>5} {'params':>6}")
    for c in cmds:
        where = str(c.file.relative_to(PACKAGE.parent))
        print(f"{c.name:<14} {where:<28} {c.file_lines:>5} {c.body_lines:>5} {c.params:>6}")
    print()
    print(f"{'package':<40} {'modules':>7}")
    for folder, n in counts.items():
        print(f"{folder:<40} {n:>7}")
    found = problems(cmds, counts)
    print()
    for line in found:
        print(f"over the limit: {line}")
    if not found:
        print(
            f"within the limits: cli files <= {MAX_CLI_FILE} lines, command bodies <= "
            f"{MAX_BODY}, <= {MAX_MODULES} modules a folder"
        )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
