"""Every record's inter-token gaps (ITL) in one flat array, built once per set of records.

A run of an hour holds millions of gaps. ``ClientRecord.itls`` builds a fresh list each
time it is read; the summary, the time windows, the stall detector, the findings and the
charts each read every record's gaps, per group and per window. ``Gaps`` computes them
once, in record order and, within a record, in chunk order: selecting a group's or a
window's gaps is then a mask over the flat array that keeps that order, so every mean,
sum and confidence interval taken over them sees the values in the order the per-record
lists give, and equals what the lists give.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from servelab.rundir import Run
from servelab.vocab import ClientRecord

_BLOCK = 1 << 20  # values handled at a time: a long run's temporaries stay a few MB


@dataclass(frozen=True)
class Gaps:
    """``values[offsets[i]:offsets[i + 1]]`` is ``records[i].itls``."""

    values: np.ndarray
    offsets: np.ndarray

    @classmethod
    def of(cls, records: Sequence[ClientRecord]) -> Gaps:
        chunks = np.fromiter((len(r.chunk_times) for r in records), np.int64, len(records))
        starts = np.zeros(len(records) + 1, np.int64)  # of each record's chunks
        np.cumsum(chunks, out=starts[1:])
        offsets = np.zeros(len(records) + 1, np.int64)
        np.cumsum(np.maximum(chunks - 1, 0), out=offsets[1:])
        values = np.empty(int(offsets[-1]), np.float64)
        for i, j in _blocks(starts, _BLOCK):  # whole records, so no gap spans two blocks
            times = np.fromiter(
                itertools.chain.from_iterable(r.chunk_times for r in records[i:j]),
                np.float64,
                int(starts[j] - starts[i]),
            )
            diffs = np.diff(times)
            # the differences that span two records: into each record's first chunk
            firsts = (starts[i:j] - starts[i])[chunks[i:j] > 0]
            keep = np.ones(diffs.size, bool)
            keep[firsts[firsts > 0] - 1] = False
            values[offsets[i] : offsets[j]] = diffs[keep]
        return cls(values, offsets)

    @property
    def counts(self) -> np.ndarray:
        """Gaps per record."""
        return np.diff(self.offsets)

    def of_record(self, i: int) -> list[float]:
        """``records[i].itls``."""
        return self.values[self.offsets[i] : self.offsets[i + 1]].tolist()

    def mask(self, rows: np.ndarray) -> np.ndarray:
        """The gaps of the records a boolean ``rows`` (one per record) selects."""
        return np.repeat(rows, self.counts)

    def pooled(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The gaps of records ``idx`` (ascending) in order, and for each the position in
        ``idx`` of its record: ``summary.metric_values(records[idx], "itl")``."""
        rows = np.zeros(len(self.offsets) - 1, bool)
        rows[idx] = True
        groups = np.repeat(np.arange(len(idx)), self.counts[idx])
        return self.values[self.mask(rows)], groups

    def blocks(self) -> Iterator[tuple[int, int]]:
        """Ranges ``[i, j)`` of records holding about a million gaps each, in order: work
        on a long run's gaps block by block keeps its temporaries small."""
        return _blocks(self.offsets, _BLOCK)

    @functools.cached_property
    def record_sums(self) -> list[float]:
        """Each record's gaps summed left to right: ``sum(records[i].itls)``, the same
        float (numpy's sums pair terms up, and round differently)."""
        out: list[float] = []
        for i, j in self.blocks():
            base = int(self.offsets[i])
            block = self.values[base : int(self.offsets[j])].tolist()
            bounds = (self.offsets[i : j + 1] - base).tolist()
            out.extend(sum(block[lo:hi]) for lo, hi in itertools.pairwise(bounds))
        return out


def _blocks(offsets: np.ndarray, size: int) -> Iterator[tuple[int, int]]:
    """Consecutive ranges ``[i, j)`` of records, each holding about ``size`` of the items
    that ``offsets`` (cumulative, from 0) counts, and at least one record."""
    n = len(offsets) - 1
    i = 0
    while i < n:
        j = int(np.searchsorted(offsets, offsets[i] + size, "right")) - 1
        j = min(max(j, i + 1), n)
        yield i, j
        i = j


def run_gaps(run: Run) -> Gaps:
    """``Gaps.of(run.records)``, built once per loaded run."""
    if "gaps" not in run.derived:
        run.derived["gaps"] = Gaps.of(run.records)
    gaps: Gaps = run.derived["gaps"]
    return gaps
