"""Splitting one run among workers, and what the workers did together.

- ``split_concurrency(c, n)``: a closed loop's ``c`` streams over ``n`` workers, as evenly
  as whole numbers allow (never a worker with none).
- ``partition(plan, weights)``: whole sessions dealt to shares in plan order; each
  session goes to the share with the fewest sessions per unit of weight, so the shares
  follow the weights (a worker's concurrency) and a session's turns stay together. The
  shares are disjoint and their union is the plan.
- ``concurrency_over_time(records, start, end)``: the requests actually in flight over
  time, from the records (one clock), as a time-weighted series and its mean and peak.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from servelab.bench.plan_runner import sessions
from servelab.bench.workloads.request_plan import PlannedRequest
from servelab.vocab import ClientRecord

MAX_POINTS = 300  # points of the concurrency series kept in the manifest
MIN_BIN_S = 0.1


def split_concurrency(concurrency: int, workers: int) -> list[int]:
    """``concurrency`` streams over at most ``workers`` workers, the first ones taking the
    remainder; fewer entries than ``workers`` when there are fewer streams than workers."""
    if concurrency < 1 or workers < 1:
        raise ValueError(f"need concurrency >= 1 and workers >= 1, got {concurrency}, {workers}")
    n = min(concurrency, workers)
    return [concurrency // n + (1 if i < concurrency % n else 0) for i in range(n)]


def partition(
    plan: Iterable[PlannedRequest], weights: Sequence[float]
) -> list[list[PlannedRequest]]:
    """Deal the plan's sessions to ``len(weights)`` shares (see the module doc)."""
    if not weights or any(not w > 0 for w in weights):
        raise ValueError(f"every share needs a weight > 0, got {list(weights)}")
    shares: list[list[PlannedRequest]] = [[] for _ in weights]
    dealt = [0] * len(weights)
    for turns in sessions(plan):
        i = min(range(len(weights)), key=lambda j: (dealt[j] / weights[j], j))
        shares[i].extend(turns)
        dealt[i] += 1
    return shares


def _span(rec: ClientRecord) -> tuple[float, float] | None:
    """When a request was in flight; None if it was never sent (skipped, lost unsent)."""
    never_answered = rec.first_byte is None and rec.done is None and not rec.chunk_times
    if never_answered and rec.error is not None and rec.actual_send <= rec.intended_send:
        return None  # recorded without a send (skipped, lost before sending)
    end = rec.done
    if end is None:
        end = rec.chunk_times[-1] if rec.chunk_times else (rec.first_byte or rec.actual_send)
    return rec.actual_send, max(end, rec.actual_send)


def concurrency_over_time(
    records: Sequence[ClientRecord], start: float, end: float
) -> dict[str, Any]:
    """Requests in flight between ``start`` and ``end``: ``series`` holds ``[t - start,
    mean in flight over the bin]``; ``mean`` is time-weighted over the whole span and
    ``max`` the instantaneous peak."""
    spans = [s for s in map(_span, records) if s is not None]
    span = max(end - start, 1e-9)
    bin_s = max(MIN_BIN_S, span / MAX_POINTS)
    if not spans:
        return {"bin_s": bin_s, "mean": 0.0, "max": 0, "series": []}
    times = np.array([t for s in spans for t in s])
    steps = np.array([d for _ in spans for d in (1, -1)])
    order = np.lexsort((steps, times))  # at a tie, the end (-1) first: back-to-back is not overlap
    times, steps = times[order], steps[order]
    level = np.cumsum(steps)  # in flight just after each event
    # area under the step function up to each event
    area = np.concatenate(([0.0], np.cumsum(level[:-1] * np.diff(times))))

    def integral(x: np.ndarray) -> np.ndarray:
        j = np.searchsorted(times, x, side="right") - 1
        inside = j >= 0
        out = np.zeros_like(x)
        jj = j[inside]
        out[inside] = area[jj] + level[jj] * (x[inside] - times[jj])
        return out

    n_bins = max(1, math.ceil(span / bin_s))
    edges = start + np.minimum(np.arange(n_bins + 1) * bin_s, span)
    per_bin = np.diff(integral(edges)) / np.maximum(np.diff(edges), 1e-12)
    total = float((integral(np.array([end])) - integral(np.array([start])))[0]) / span
    return {
        "bin_s": bin_s,
        "mean": total,
        "max": int(level.max()),
        "series": [
            [round(float(e - start), 4), round(float(v), 3)]
            for e, v in zip(edges[:-1], per_bin, strict=True)
        ],
    }
