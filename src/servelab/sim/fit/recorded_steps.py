"""Rebuild each recorded step's work from a run directory (for calibration and profiles).

A step record says which requests took how many prefill tokens and which decoded; the
timelines say where each admission's prefill started (its cached tokens). Walking the
steps in order, tracking every request's computed tokens and outputs, gives the
context of each sequence in each step, hence its :class:`StepWork`.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass

from servelab.rundir import Run
from servelab.sim.costs.work import StepWork


@dataclass
class MeasuredStep:
    work: StepWork
    duration: float  # the step record's end - start
    gap: float | None  # start of this step - end of the previous one, when back to back


def measured_steps(run: Run) -> list[MeasuredStep]:
    """The run's steps with their work, in order. Raises ValueError when it has none.

    Steps are ordered by ``step_id``; a run whose step ids repeat (several replicas)
    cannot be replayed as one engine and is refused.
    """
    steps = sorted(run.steps, key=lambda s: s.step_id)
    if not steps:
        raise ValueError(
            f"{run.path} has no steps.jsonl records; calibrate on a run of a servelab "
            "server (it records its steps), not on another endpoint"
        )
    if len({s.step_id for s in steps}) != len(steps):
        raise ValueError(
            f"{run.path} holds steps of several engines; calibrate on a one-replica run"
        )
    chunk_at: dict[tuple[str, int], int] = {}
    prompt: dict[str, int] = {}
    for tl in run.timelines.values():
        prompt[tl.request_id] = tl.prompt_tokens
        for c in tl.chunks:
            chunk_at[(tl.request_id, c.step_id)] = c.cached_tokens
    pos: dict[str, int] = {}
    outs: dict[str, int] = {}
    out: list[MeasuredStep] = []
    prev_end: float | None = None
    for s in steps:
        for rid in s.preempted:
            pos.pop(rid, None)
        w = StepWork()
        for rid, n in s.prefill.items():
            start = pos[rid] if rid in pos else chunk_at.get((rid, s.step_id), 0)
            total = prompt.get(rid, start + n) + outs.get(rid, 0)
            sampled = start + n >= total
            w.add(n, start, 1 if sampled else 0)
            pos[rid] = start + n
            if sampled:
                outs[rid] = outs.get(rid, 0) + 1
        for rid in s.decode:
            start = pos.get(rid, prompt.get(rid, 0) + outs.get(rid, 0) - 1)
            w.add(1, start, 1)
            pos[rid] = start + 1
            outs[rid] = outs.get(rid, 0) + 1
        gap = (s.start - prev_end) if prev_end is not None else None
        out.append(MeasuredStep(w, s.end - s.start, gap))
        prev_end = s.end
    return out


def busy_gaps(steps: list[MeasuredStep], idle_threshold: float = 0.05) -> list[tuple[int, float]]:
    """``(sequences in the step before, gap)`` for every gap between one step's end and the
    next one's start while the engine is busy (gaps above ``idle_threshold`` seconds are
    idle time, not overhead). The gap holds the engine's and the server's work on the
    step's outputs (stop rules, detokenization, one stream write per sequence) and the
    scheduling of the next step."""
    return [
        (prev.work.seqs, m.gap)
        for prev, m in itertools.pairwise(steps)
        if m.gap is not None and 0 <= m.gap < idle_threshold
    ]


def busy_gap(steps: list[MeasuredStep], idle_threshold: float = 0.05) -> float:
    """Median of :func:`busy_gaps` (0 when there is none)."""
    gaps = [g for _, g in busy_gaps(steps, idle_threshold)]
    return statistics.median(gaps) if gaps else 0.0
