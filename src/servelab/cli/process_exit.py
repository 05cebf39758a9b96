"""Ending the `servelab` process without freeing what a command built.

A whole-trace `servelab sim` ends holding tens of millions of objects (the run's records,
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
from typing import NoReturn

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
