"""Running the benchmark's event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on uvloop when it is installed (a lower cost per socket event), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
