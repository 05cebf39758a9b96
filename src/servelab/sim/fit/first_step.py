"""How much of a burst an idle server's first step takes, read off its runs.

A client that sends several requests at one instant to an idle server does not get them
prefilled together. The server's front end (HTTP, the chat template, tokenisation, the
hand-over to the engine) takes them one at a time while the engine starts its first step
on the first it has; the rest join the next step. On this host vLLM-CPU's first step took
one request of four in six of nine runs, llama-server's two of four in six of nine
(docs/design/twin.md). A simulator that hands the engine the whole burst at once prefills
it in one step: every first token comes together, late for the first requests and early
for the rest.

How much the front end hands over depends on the requests: llama-server's first step took
every one of four 64-token prompts in every run, and two or three of four chat, agent or
RAG prompts (100-800 tokens). So each burst's share is kept with its prompts' mean length,
and a prediction uses the shares of the bursts nearest in length
(``sim.costs.serving_path.ServingPath.share_for``).

``first_step`` reads one run's opening burst: where its first requests were sent within
``BURST_WINDOW_S`` of each other (two or more, all completed), the share of them whose
first token came with the earliest (within ``SAME_STEP_REL`` of its latency, or
``SAME_STEP_S``), out of as many as the server's sequence cap lets one step hold. A burst
whose first step was full says nothing of the hand-over: where the step left some out and
the smallest of them would not have fitted the token budget beside those it took, the run
has no share. ``first_steps`` gathers them over runs; a twin states them
(``TwinCalibration.first_steps``) and its serving path replays them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

BURST_WINDOW_S = 0.005  # sends this close are one burst (the client sends them at once)
SAME_STEP_REL = 0.05  # first tokens this close (relative to the earliest's latency) ...
SAME_STEP_S = 0.002  # ... or this close came out of one step


def first_step(records: Sequence[Any], budget: int | None, slots: int | None) -> list[float] | None:
    """``[mean prompt tokens, share]`` of a run's opening burst (module doc): the share its
    first step took of the burst, or of ``slots`` where the burst is larger. None where the
    run opens with no burst of two or more complete requests, or its first step was full
    (the rest would not have fitted ``budget`` prompt tokens; None: no budget known)."""
    sent = sorted((r for r in records if r.actual_send is not None), key=lambda r: r.actual_send)
    if len(sent) < 2:
        return None
    start = sent[0].actual_send
    burst = [r for r in sent if r.actual_send - start <= BURST_WINDOW_S]
    if len(burst) < 2 or not all(r.ok and r.ttft is not None for r in burst):
        return None
    earliest = min(r.actual_send + r.ttft for r in burst)
    same = max(SAME_STEP_S, SAME_STEP_REL * (earliest - start))
    firsts = [r.actual_send + r.ttft - earliest <= same for r in burst]
    took = [r.input_tokens for r, first in zip(burst, firsts, strict=True) if first]
    left = [r.input_tokens for r, first in zip(burst, firsts, strict=True) if not first]
    room = min(len(burst), slots) if slots else len(burst)
    if left and len(took) < room and (budget is None or sum(took) + min(left) > budget):
        return None
    mean_prompt = sum(r.input_tokens for r in burst) / len(burst)
    return [mean_prompt, min(1.0, len(took) / room)]


def first_steps(
    runs: Sequence[Sequence[Any]], budget: int | None, slots: int | None
) -> list[list[float]] | None:
    """Every run's ``first_step`` (each a sequence of client records) that has one, by
    prompt length; None where none has."""
    found = [s for records in runs if (s := first_step(records, budget, slots)) is not None]
    return sorted(found) or None
