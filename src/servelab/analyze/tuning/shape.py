"""What a run's own shape calls for: the knobs worth trying whether or not a finding fired.

A finding fires on a symptom strong enough to name; tune also tries the knobs the run's
traffic and its server's settings make relevant (``shape_knobs``), each with the fact that
calls for it:

- ``chunking``: a prompt of at least ``LONG_PROMPT`` tokens ran while other sequences did;
- ``max_num_seqs``: steps ran at the sequence cap while requests waited;
- ``prefix_caching``: requests share a prompt prefix and prefix caching is off;
- ``kv_memory``: requests were preempted (the KV pool ran out);
- ``priorities``: the workload has more than one class;
- ``speculation``: the run speculated (its acceptance is known);
- ``replicas``: requests waited for the engine (predicted only: one machine cannot verify it).

Disaggregation is called for by the same shape as chunking; it is reported as not
predicted, with the catalogue's reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from servelab.rundir import Run

MIN_BUDGET = 64
LONG_PROMPT = 4 * MIN_BUDGET  # a prompt at least this long stalls decodes for several chunks


@dataclass(frozen=True)
class RunFacts:
    """What the grids are built around: the resolved engine config as run, each request's
    prompt length, each class's priority, the most sequences one step ran, whether the
    run speculated, and where it did not, the acceptance a probe of its traffic measured
    (None: not measured). The shape: requests that share a prompt prefix with another,
    steps that ran at the sequence cap while requests waited, steps with requests waiting,
    and preemptions (0 where the run has no step records)."""

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
    """The shape fields of :class:`RunFacts` from a run's records and steps (a run without
    step records -- another server's -- has no waits or preemptions to count)."""
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
    }
