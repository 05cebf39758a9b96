"""Search for the highest request rate that still meets the SLOs.

``find_max_rate(trial, start)`` runs ``await trial(rate) -> bool`` (did this rate keep
its goodput fraction above the target?) at a sequence of rates: doubling from
``start`` while they pass (or halving while they fail) until one brackets the limit,
then a few bisection steps at the geometric mean of the highest pass and the lowest
fail above it. Every rate is tried at most once.

Both the search and ``--sweep`` stop raising the load at a stage that never reached a
steady state (``saturated``: the ``over_saturated`` verdict of ``analyze.timeslices``):
its percentiles depend on how long it ran, and a higher rate would only queue more.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

MAX_BRACKET_STEPS = 8


def saturated(summary: dict[str, Any] | None) -> bool:
    """Whether a stage's ``summarize`` body says its queue grew through the run."""
    ts = (summary or {}).get("timeslices") or {}
    return bool(ts.get("saturation", {}).get("state") == "over_saturated")


def sweep_stop(over: str, values: list[float], done: int, summary: dict[str, Any] | None) -> str:
    """Why a sweep ends after stage ``done`` (0-based), or "" to go on: that stage was
    over-saturated and every later value only adds load."""
    rest = values[done + 1 :]
    if not rest or not saturated(summary) or any(v <= values[done] for v in rest):
        return ""
    return (
        f"{over}={values[done]:g} never reached a steady state (its queue grew through the "
        f"stage); the higher {over} values {', '.join(f'{v:g}' for v in rest)} were not run"
    )


@dataclass
class SearchResult:
    passed: list[float] = field(default_factory=list)
    failed: list[float] = field(default_factory=list)

    @property
    def max_rate(self) -> float | None:
        """The highest passing rate below every failing one (None: none passed)."""
        ok = [r for r in self.passed if all(r < f for f in self.failed)]
        return max(ok) if ok else None

    @property
    def lowest_failing(self) -> float | None:
        best = self.max_rate or 0.0
        above = [r for r in self.failed if r > best]
        return min(above) if above else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_rate": self.max_rate,
            "lowest_failing_rate": self.lowest_failing,
            "passed": sorted(self.passed),
            "failed": sorted(self.failed),
        }


async def find_max_rate(
    trial: Callable[[float], Awaitable[bool | None]],
    start: float,
    bisect_steps: int = 3,
) -> SearchResult:
    """Bracket then bisect; ``trial`` returning None stops the search (interrupted)."""
    res = SearchResult()

    async def run(rate: float) -> bool | None:
        ok = await trial(rate)
        if ok is not None:
            (res.passed if ok else res.failed).append(rate)
        return ok

    rate = start
    first = await run(rate)
    if first is None:
        return res
    for _ in range(MAX_BRACKET_STEPS):
        rate = rate * 2 if first else rate / 2
        ok = await run(rate)
        if ok is None:
            return res
        if ok != first:
            break
    for _ in range(bisect_steps):
        lo, hi = res.max_rate, res.lowest_failing
        if lo is None or hi is None:
            break
        if await run(math.sqrt(lo * hi)) is None:
            break
    return res
