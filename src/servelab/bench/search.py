"""Search for the highest request rate that still meets the SLOs.

``find_max_rate(trial, start)`` runs ``await trial(rate) -> bool`` (did this rate keep
its goodput fraction above the target?) at a sequence of rates: doubling from
``start`` while they pass (or halving while they fail) until one brackets the limit,
then a few bisection steps at the geometric mean of the highest pass and the lowest
fail above it. Every rate is tried at most once.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

MAX_BRACKET_STEPS = 8


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
