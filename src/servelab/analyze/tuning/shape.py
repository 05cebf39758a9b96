"""What a run's own shape calls for: the knobs worth trying whether or not a finding fired.

A finding fires on a symptom strong enough to name; tune also tries the knobs the run's
traffic and its server's settings make relevant (``shape_knobs``), each with the fact that
calls for it:

- ``chunking``: a prompt of at least ``LONG_PROMPT`` tokens ran while other sequences did;
- ``max_num_seqs``: steps ran at the sequence cap while requests waited (for a run without
  step records, another server's: requests were sent while the cap's worth of requests
  was already in flight, as the client saw them);
- ``prefix_caching``: requests share a prompt prefix and prefix caching is off;
- ``kv_memory``: requests were preempted (the KV pool ran out);
- ``priorities``: the workload has more than one class;
- ``speculation``: the run speculated (its acceptance is known);
- ``replicas``: requests waited for the engine (predicted only: one machine cannot verify it).

Disaggregation is called for by the same shape as chunking; it is reported as not
predicted, with the catalogue's reason.

The operator's objective calls for knobs too (``objective_knobs``): a run can be healthy
by every finding and still miss the figure its operator cares about. A per-token objective
(TPOT or ITL) calls for the two knobs that shorten a decode step or make it yield more:

- ``max_num_seqs``: more than one sequence ran in a step (fewer make each step shorter;
  the others wait);
- ``speculation``: the run speculated, or a probe of its traffic measured the acceptance.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from servelab.rundir import Run
from servelab.vocab import ClientRecord

MIN_BUDGET = 64
LONG_PROMPT = 4 * MIN_BUDGET  # a prompt at least this long stalls decodes for several chunks


@dataclass(frozen=True)
class RunFacts:
    """What the grids are built around: the resolved engine config as run, each request's
    prompt length, each class's priority, the most sequences one step ran, whether the
    run speculated, and where it did not, the acceptance a probe of its traffic measured
    (None: not measured). The shape: requests that share a prompt prefix with another,
    steps that ran at the sequence cap while requests waited, steps with requests waiting,
    and preemptions (0 where the run has no step records); for a run without step records,
    the requests sent while at least the sequence cap's worth were in flight
    (``arrived_at_cap``)."""

    config: dict[str, Any]
    prompt_tokens: Sequence[int]
    priorities: dict[str, int]
    peak_seqs: int
    speculated: bool = False
    probed_acceptance: float | None = None
    shared_prefix_requests: int = 0
    waited_at_cap: int = 0
    waited: int = 0
    preemptions: int = 0
    arrived_at_cap: int = 0


def shape_knobs(facts: RunFacts) -> dict[str, str]:
    """Knob -> the fact of the run that calls for it (module doc)."""
    cfg = facts.config
    out: dict[str, str] = {}
    longest = max(facts.prompt_tokens, default=0)
    if longest >= LONG_PROMPT and facts.peak_seqs > 1:
        out["chunking"] = (
            f"prompts up to {longest} tokens ran beside other sequences "
            f"(up to {facts.peak_seqs} in a step)"
        )
    if facts.waited_at_cap:
        out["max_num_seqs"] = (
            f"{facts.waited_at_cap} steps ran at the cap of {cfg.get('max_num_seqs')} "
            "sequences while requests waited"
        )
    elif facts.arrived_at_cap:
        out["max_num_seqs"] = (
            f"{facts.arrived_at_cap} requests were sent with the cap of "
            f"{cfg.get('max_num_seqs')} sequences already in flight"
        )
    if facts.shared_prefix_requests > 1 and cfg.get("enable_prefix_caching") is False:
        out["prefix_caching"] = (
            f"{facts.shared_prefix_requests} requests share a prompt prefix and prefix caching "
            "is off"
        )
    if facts.preemptions and cfg.get("num_kv_blocks"):
        out["kv_memory"] = f"{facts.preemptions} preemptions: the KV pool ran out"
    if len(facts.priorities) > 1:
        out["priorities"] = (
            f"{len(facts.priorities)} classes: {', '.join(sorted(facts.priorities))}"
        )
    if facts.speculated:
        out["speculation"] = "the run speculated, so its acceptance is known"
    if facts.waited:
        out["replicas"] = (
            f"requests waited in {facts.waited} steps (more replicas are predicted only: "
            "one machine cannot verify them)"
        )
    return out


def run_shape(run: Run, max_num_seqs: int | None) -> dict[str, int]:
    """The shape fields of :class:`RunFacts` from a run's records and steps. A run without
    step records (another server's) has no waits or preemptions to count; what its client
    saw stands in for the cap: the requests sent while ``max_num_seqs`` were in flight."""
    groups: dict[str, int] = {}
    for r in run.records:
        if r.prefix_group:
            groups[r.prefix_group] = groups.get(r.prefix_group, 0) + 1
    waiting = [s for s in run.steps if s.num_waiting > 0]
    cap = max_num_seqs or 0
    return {
        "shared_prefix_requests": sum(n for n in groups.values() if n > 1),
        "waited_at_cap": sum(cap > 0 and s.decode_seqs + len(s.prefill) >= cap for s in waiting),
        "waited": len(waiting),
        "preemptions": sum(len(s.preempted) for s in run.steps),
        "arrived_at_cap": 0 if run.steps or cap <= 0 else arrived_at_cap(run.records, cap),
    }


def arrived_at_cap(records: Sequence[ClientRecord], cap: int) -> int:
    """Requests sent while at least ``cap`` earlier ones were still in flight (sent, and
    not yet done or failed), as the client timed them."""
    spans = sorted(
        (r.actual_send, r.done if r.done is not None else r.actual_send) for r in records
    )
    ends: list[float] = []  # a min-heap of the in-flight requests' ends
    n = 0
    for start, end in spans:
        while ends and ends[0] <= start:
            heapq.heappop(ends)
        n += len(ends) >= cap
        heapq.heappush(ends, end)
    return n


# Objectives paid per output token: a decode step's length or yield moves them directly.
PER_TOKEN = ("tpot_", "itl_")


def objective_knobs(figure: str, facts: RunFacts) -> dict[str, str]:
    """Knob -> why the objective ``figure`` calls for it (module doc); {} for an objective
    not paid per output token."""
    if not figure.startswith(PER_TOKEN):
        return {}
    out: dict[str, str] = {}
    if facts.peak_seqs > 1:
        out["max_num_seqs"] = (
            f"the objective is per output token and up to {facts.peak_seqs} sequences "
            "shared a step: fewer make each step shorter"
        )
    if facts.speculated or facts.probed_acceptance is not None:
        out["speculation"] = (
            "the objective is per output token and the acceptance of n-gram drafts on this "
            "traffic is known: accepted drafts make several tokens a step"
        )
    return out
