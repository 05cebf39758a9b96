"""Real text for a trace's rows: ``servelab bench --trace T --dataset D``.

A trace gives each request's send time and lengths but no text. ``TraceText`` hands every
row the dataset record whose first user turn is nearest the row's prompt length in tokens,
each record used once before any is used again (so unrelated rows do not share a prompt and
fake prefix-cache hits); the planner then cuts that text to the row's exact length, or pads a
shorter one with corpus text (``RULE``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

from servelab.bench.datasets import Dataset
from servelab.bench.datasets.select import pairs

RULE = (
    "each trace row takes the dataset record whose first user turn is nearest its prompt "
    "length in tokens (every record once before any is reused), cut to the row's exact "
    "length, or padded with corpus text when shorter"
)


class TraceText:
    """Hands out dataset texts by nearest token length (see the module docstring)."""

    def __init__(self, ds: Dataset, count: Callable[[str], int]) -> None:
        self._texts: list[tuple[str, str]] = []  # (record id, first user turn)
        for conv in ds.conversations:
            turns = pairs(conv)
            if turns and turns[0][0].strip():
                self._texts.append((conv.id, turns[0][0]))
        if not self._texts:
            raise ValueError("the dataset has no record with a user turn to replay a trace with")
        self._lengths = [count(text) for _, text in self._texts]
        self._free: list[tuple[int, int]] = []  # (length, index) not yet used this round
        self.reused = 0
        self.used: set[int] = set()
        self._refill()

    def _refill(self) -> None:
        self._free = sorted((n, i) for i, n in enumerate(self._lengths))

    def pick(self, tokens: int) -> tuple[str, str]:
        """The (record id, text) nearest ``tokens`` among the records not yet handed out."""
        if not self._free:
            self.reused += 1
            self._refill()
        k = bisect.bisect_left(self._free, (tokens, -1))
        near = [j for j in (k - 1, k) if 0 <= j < len(self._free)]
        j = min(near, key=lambda j: (abs(self._free[j][0] - tokens), j))
        _, i = self._free.pop(j)
        self.used.add(i)
        return self._texts[i]

    def report(self, ds: Dataset) -> dict[str, Any]:
        return {
            "dataset": ds.info,
            "rule": RULE,
            "records_with_text": len(self._texts),
            "records_used": len(self.used),
            "rounds_reused": self.reused,
        }
