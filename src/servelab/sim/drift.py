"""Run-level speed drift: level the runs of a run-derived profile before pooling them.

This machine's speed wanders by 10-20% over minutes (docs/design/sim.md): the same
one-sequence decode took 34 ms in one training run and 38 ms in the next. A profile pools
the steps of several runs, and the runs cover different shapes (only a multi-turn run
reaches long contexts), so a slow run's level is read as the cost of its shapes: a slow
long-context run steepens the fitted context slope, and held-out steps at contexts between
the runs' are mispriced.

:func:`run_speeds` measures each run's speed on an anchor every workload has -- decode
steps of one sequence at a short context -- as the median of measured over fitted time,
so that the small context differences between runs' anchors stay with the fit. Dividing a
run's steps by its factor levels the runs to their common (geometric) mean; the profile
then prices every shape at the mean speed of the training runs. The factors are relative:
they say how the runs differed, not how fast the machine is.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from servelab.sim.work import StepWork

ANCHOR_MAX_CONTEXT = 768  # tokens: every workload's single decodes reach this far
MIN_ANCHORS = 20  # per run: fewer give a median too noisy to correct by


def is_anchor(w: StepWork) -> bool:
    """One sequence decoding at a short context, and nothing else in the step."""
    return w.prefill_tokens == 0 and w.decode_seqs == 1 and w.kv_read <= ANCHOR_MAX_CONTEXT


def run_speeds(
    runs: list[list[tuple[StepWork, float]]], predict: Callable[[StepWork], float]
) -> list[float] | None:
    """Each run's speed factor (measured over ``predict``ed anchor time, over the runs'
    geometric mean), from its ``(work, seconds)`` steps. None when there is nothing to
    level: a single run, or a run with fewer than ``MIN_ANCHORS`` anchors (its level
    could not be told from its shapes)."""
    if len(runs) < 2:
        return None
    medians = []
    for steps in runs:
        ratios = [t / predict(w) for w, t in steps if is_anchor(w) and t > 0]
        if len(ratios) < MIN_ANCHORS:
            return None
        medians.append(statistics.median(ratios))
    mean = math.exp(statistics.fmean(math.log(m) for m in medians))
    return [m / mean for m in medians]
