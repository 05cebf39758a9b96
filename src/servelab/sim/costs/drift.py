"""Run-level speed drift: how far the runs pooled into one profile differed in speed.

This machine's speed wanders by 10-20% over minutes (docs/design/sim.md): the same
one-sequence decode took 34 ms in one training run and 38 ms in the next. A profile pools
the steps of several runs and prices each shape at their typical time, so it predicts a
machine about as fast as the training runs were on average; a held-out run on a faster or
slower stretch of minutes is off by that much, whatever the simulator does.

:func:`run_speeds` measures each run's speed on an anchor every workload has -- decode
steps of one sequence at a short context -- as the median of measured over fitted time
(so the small context differences between the runs' anchors stay with the fit), relative
to the runs' geometric mean. ``servelab profile --from-run`` records the factors and says
how far apart they are. It does not divide them out: levelling the runs to their mean
before the fit was tried and did not predict held-out runs better (docs/design/sim.md),
because the drift is not one factor per run: of two agent runs minutes apart, the second
decoded three sequences at 1,200 tokens 36% slower than the first, and one sequence at 300
tokens only 8% slower.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from servelab.sim.costs.profiled import ProfileSample
from servelab.sim.costs.work import StepWork

ANCHOR_MAX_CONTEXT = 768  # tokens: every workload's single decodes reach this far
MIN_ANCHORS = 20  # per run: fewer give a median too noisy to compare


def is_anchor(w: StepWork) -> bool:
    """One sequence decoding at a short context, and nothing else in the step."""
    return w.prefill_tokens == 0 and w.decode_seqs == 1 and w.kv_read <= ANCHOR_MAX_CONTEXT


def run_speeds(
    runs: list[list[ProfileSample]], predict: Callable[[StepWork], float]
) -> list[float] | None:
    """Each run's speed factor (measured over ``predict``ed anchor time, over the runs'
    geometric mean), from its measured steps. None when there is nothing to
    compare: a single run, or a run with fewer than ``MIN_ANCHORS`` anchors (its speed
    could not be told from its shapes)."""
    if len(runs) < 2:
        return None
    medians = []
    for steps in runs:
        ratios = [s.time / predict(s.work) for s in steps if is_anchor(s.work) and s.time > 0]
        if len(ratios) < MIN_ANCHORS:
            return None
        medians.append(statistics.median(ratios))
    mean = statistics.geometric_mean(medians)
    return [m / mean for m in medians]
