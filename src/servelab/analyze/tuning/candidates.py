"""Candidate settings: what each finding's levers could be set to, as settings to simulate.

A finding names levers (``Finding.levers``: ``batch_budget_down``, ``max_num_seqs_up``, ...).
Each lever moves a *knob* -- one engine setting or one deployment choice -- and one knob may
be pulled both ways by different findings (long prefills stall decodes: a smaller chunk
budget; prompts wait for their prefill: a larger one). So candidates are made per knob,
over a grid that covers both directions whenever any finding calls for the knob, and the
decision (``analyze.tuning.decision``) keeps at most one value per knob.

The levers, their knobs and how each knob's values are derived are catalogued in
``analyze.lever_catalogue`` (``KNOBS[...].values``); the grids are built here. Speculation
is tried only when the run speculated or a probe of its traffic measured the acceptance
(``RunFacts.probed_acceptance``): acceptance is a property of the text and the sampling,
which the simulator cannot know otherwise. Replicas are hardware, reported as capacity.

Levers the simulator cannot replay come back as :class:`Unpredicted` with the reason.
Each candidate has a *target*: the figure the finding behind its direction is about; the
decision recommends it only if that figure is predicted to improve.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servelab.analyze.diagnosis.findings import Finding
from servelab.analyze.lever_catalogue import COMPLEXITY, LAUNCH, LEVERS, cli_flag, lever_knob
from servelab.analyze.server_side.serversettings import SERVELAB, render_flags
from servelab.analyze.tuning.shape import MIN_BUDGET, RunFacts, objective_knobs, shape_knobs
from servelab.vocab import DEFAULT_TOKEN_BUDGET

# The figure each finding is about: a candidate answering it must improve this figure.
FINDING_TARGET = {
    "itl_prefill_interference": ("overall", "max_itl_mean"),
    "prefill_bound": ("overall", "ttft_p95"),
    "queue_bound": ("overall", "ttft_p95"),
    "over_saturated": ("overall", "ttft_p50"),
    "kv_pressure": ("overall", "e2e_p95"),
    "low_prefix_reuse": ("overall", "ttft_mean"),
    "decode_bound": ("overall", "tpot_p50"),
}
NEAR = 0.2  # a prompt quantile this close to a power of two in the grid adds nothing new
REPLICAS = (2, 3, 4)
KV_FACTORS = (1.5, 2.0, 4.0)
SPEC_K = (2, 4, 8)
# The most candidates one tune simulates (each under every seed); the knobs findings call
# for come first, and what does not fit is reported as not predicted, by id.
SEARCH_BUDGET = 32


@dataclass(frozen=True)
class Candidate:
    """One setting to simulate: engine config changes, class priorities, replicas.

    ``lever`` is the direction it goes (a ``Finding.levers`` name), ``findings`` the
    findings that call for that direction (empty: the knob's other side, tried so that
    the knob is decided once), ``target`` the (scope, figure) it must improve."""

    id: str
    knob: str
    lever: str
    title: str
    engine: dict[str, Any] = field(default_factory=dict)
    priorities: dict[str, int] = field(default_factory=dict)
    replicas: int = 1
    findings: tuple[str, ...] = ()
    target: tuple[str, str] = ("overall", "goodput")
    cost: str = ""
    # What the operator takes on (``catalogue.COMPLEXITY``; ``operates``: what they must
    # run, watch and roll back), and how many settings at once (a combination: several).
    complexity: str = "low"
    operates: str = ""
    parts: int = 1
    because: str = ""  # what calls for it: its findings, or the run's shape

    @property
    def operating_load(self) -> tuple[int, int]:
        """Less to operate sorts first: the complexity, then the settings applied at once."""
        return COMPLEXITY.index(self.complexity), self.parts

    @property
    def hardware(self) -> bool:
        """More hardware than the run had (not a setting of the same machine)."""
        return self.replicas > 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "knob": self.knob,
            "lever": self.lever,
            "title": self.title,
            "engine": self.engine,
            "priorities": self.priorities,
            "replicas": self.replicas,
            "findings": list(self.findings),
            "target": list(self.target),
            "cost": self.cost,
            "complexity": self.complexity,
            "operates": self.operates,
            "parts": self.parts,
            "because": self.because,
        }


@dataclass(frozen=True)
class Unpredicted:
    lever: str
    findings: tuple[str, ...]
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"lever": self.lever, "findings": list(self.findings), "reason": self.reason}


def serve_flags(engine: dict[str, Any]) -> str:
    """Engine config fields as `servelab serve` flags (the KV pool as a block count)."""
    parts = []
    for k, v in engine.items():
        if v is None:
            continue
        if k == "num_kv_blocks":
            parts.append(cli_flag("num_gpu_blocks_override", v))
        elif k == "speculative_config":
            parts.append(f"--speculative-config {shlex.quote(json.dumps(v))}")
        elif k in ("kv_cache_memory_gb", "kv_cache", "prefix_cache_scope"):
            # The block count says the pool exactly; the KV cache's implementation (the fast
            # one or its plain reference, which computes the same) is no launch setting, nor
            # is the scope of its prefix cache (servelab's is shared; "finished" is how a
            # twin copies llama-server's).
            continue
        else:
            parts.append(cli_flag(k, v))
    return " ".join(parts)


def server_changes(engine: dict[str, Any]) -> dict[str, Any]:
    """A candidate's engine changes as a launch command sets them: the KV pool by its block
    count (which says it exactly), no unset values."""
    return {k: v for k, v in engine.items() if v is not None and k != "kv_cache_memory_gb"}


def launch_action(kind: str, engine: dict[str, Any]) -> str:
    """The command that applies ``engine``: `servelab serve` flags, or the ``kind`` server's
    own (``vllm serve --max-num-batched-tokens 512``, ``serversettings.render_flags``)."""
    if kind == SERVELAB:
        return f"servelab serve {serve_flags(engine)}"
    return f"{LAUNCH[kind][0]} {render_flags(kind, server_changes(engine))}"


def _elsewhere(lever: str) -> str:
    """Why ``lever`` is not predicted for another server ("": it can be; a pair's lever,
    ``a+b``, is judged by its settings)."""
    lv = LEVERS.get(lever)
    return lv.elsewhere if lv is not None else ""


def for_server(
    kind: str, cands: list[Candidate], skipped: list[Unpredicted]
) -> tuple[list[Candidate], list[Unpredicted]]:
    """The candidates a ``kind`` server can be launched with, each in its own flags; the
    others join the unpredicted with the reason (a setting it has no flag for, class
    priorities), and disaggregation says why it is not predicted for that server. A
    servelab run keeps every candidate."""
    if kind == SERVELAB:
        return cands, skipped
    keep: list[Candidate] = []
    out = [
        Unpredicted(u.lever, u.findings, elsewhere) if (elsewhere := _elsewhere(u.lever)) else u
        for u in skipped
    ]
    said: set[tuple[str, str]] = set()
    for c in cands:
        reason = LEVERS["priorities"].elsewhere if c.priorities else None
        if reason is None and c.engine:
            try:
                render_flags(kind, server_changes(c.engine))
            except ValueError as e:
                reason = str(e)
        if reason is None:
            keep.append(c)
        elif (c.lever, reason) not in said:
            said.add((c.lever, reason))
            out.append(Unpredicted(c.lever, c.findings, reason))
    return keep, out


def joint(parts: Sequence[Candidate], knob: str, because: str = "") -> Candidate:
    """One candidate that applies ``parts`` at once, as ``knob``; its target is the first
    part's, its complexity the highest of theirs."""
    engine: dict[str, Any] = {}
    prio: dict[str, int] = {}
    for c in parts:
        engine.update(c.engine)
        prio.update(c.priorities)
    return Candidate(
        id="+".join(c.id for c in parts),
        knob=knob,
        lever="+".join(c.lever for c in parts),
        title=" and ".join(c.title for c in parts),
        engine=engine,
        priorities=prio,
        findings=tuple(dict.fromkeys(f for c in parts for f in c.findings)),
        target=parts[0].target,
        cost="; ".join(c.cost for c in parts),
        complexity=max((c.complexity for c in parts), key=COMPLEXITY.index),
        operates="; ".join(dict.fromkeys(c.operates for c in parts if c.operates)),
        parts=sum(c.parts for c in parts),
        because=because,
    )


def pairs(cands: Sequence[Candidate]) -> list[Candidate]:
    """Where two findings pull on two knobs of one run, each pair of those knobs at once:
    the middle of each knob's values in its finding's direction (grid order, the lower
    middle), as knob ``A+B``. Class priorities (which class is arbitrary) and replicas
    (hardware) are left out."""
    middle: dict[str, Candidate] = {}
    for knob in dict.fromkeys(c.knob for c in cands):
        if knob in ("priorities", "replicas"):
            continue
        asked = [c for c in cands if c.knob == knob and c.findings]
        if asked:
            middle[knob] = asked[(len(asked) - 1) // 2]
    out = []
    knobs = list(middle)
    for i, a in enumerate(knobs):
        for b in knobs[i + 1 :]:
            ca, cb = middle[a], middle[b]
            if set(ca.findings) == set(cb.findings):
                continue  # one finding, two knobs: each alone answers it
            out.append(
                joint(
                    [ca, cb],
                    f"{a}+{b}",
                    f"two findings pull on this run: {', '.join(ca.findings)} ({a}) and "
                    f"{', '.join(cb.findings)} ({b})",
                )
            )
    return out


def budget_grid(prompt_tokens: Sequence[int], current: int | None) -> list[int]:
    """Chunk budgets around the prompt lengths (module doc), without ``current``."""
    if not prompt_tokens:
        return []
    longest = max(prompt_tokens)
    values = set()
    b = MIN_BUDGET
    while True:
        values.add(b)
        if b >= longest:
            break
        b *= 2
    powers = sorted(values)
    for q in (25, 50, 90):
        v = max(MIN_BUDGET, int(math.ceil(float(np.percentile(prompt_tokens, q)) / 16) * 16))
        if all(abs(v - p) > NEAR * p for p in powers):
            values.add(v)
    return sorted(values - {current})


def seqs_grid(peak: int, current: int) -> list[int]:
    down = {max(1, round(peak * f)) for f in (0.25, 0.5, 0.75)}
    up = {current * 2, current * 4}
    return sorted(v for v in down | up if v != current and (v < min(peak, current) or v > current))


def _by_lever(findings: Sequence[Finding]) -> dict[str, list[Finding]]:
    out: dict[str, list[Finding]] = {}
    for f in findings:
        for lever in f.levers:
            out.setdefault(lever, []).append(f)
    return out


def _target(found: list[Finding], default: tuple[str, str]) -> tuple[str, str]:
    for f in found:
        if f.id in FINDING_TARGET:
            return FINDING_TARGET[f.id]
    return default


def generate(
    findings: Sequence[Finding], facts: RunFacts, objective: tuple[str, str]
) -> tuple[list[Candidate], list[Unpredicted]]:
    """Candidates for every knob a finding, the run's shape (``shape.shape_knobs``) or the
    objective (``shape.objective_knobs``) calls for, at most ``SEARCH_BUDGET``, and the
    levers left unpredicted (with what the budget skipped).

    ``objective`` (scope, figure) is the target of a candidate that no finding's direction
    calls for (the other side of a knob, or a knob only the shape calls for)."""
    levers = _by_lever(findings)
    knob_of = lever_knob()
    called = {knob_of[lever] for lever in levers if lever in knob_of}
    asked = objective_knobs(objective[1], facts)
    shape = shape_knobs(facts)
    knobs = called | set(shape) | set(asked)
    cfg = facts.config
    out: list[Candidate] = []
    skipped: list[Unpredicted] = []

    def because(lever: str, knob: str) -> str:
        found = levers.get(lever, [])
        if found:
            return "the findings " + ", ".join(f.id for f in found)
        if knob in shape:
            return f"the run's shape: {shape[knob]}"
        if knob in asked:
            return asked[knob]
        return "the other side of a knob a finding calls for"

    def make(lever: str, **kw: Any) -> Candidate:
        found = levers.get(lever, [])
        return Candidate(
            lever=lever,
            findings=tuple(f.id for f in found),
            target=_target(found, objective) if found else objective,
            complexity=LEVERS[lever].complexity,
            operates=LEVERS[lever].operates,
            because=because(lever, kw["knob"]),
            **kw,
        )

    if "chunking" in knobs:
        chunked = bool(cfg.get("enable_chunked_prefill", True))
        current = int(cfg.get("max_num_batched_tokens") or DEFAULT_TOKEN_BUDGET)
        for b in budget_grid(facts.prompt_tokens, current if chunked else None):
            lever = (
                "chunked_prefill"
                if not chunked
                else ("batch_budget_down" if b < current else "batch_budget_up")
            )
            out.append(
                make(
                    lever,
                    id=f"chunk-{b}",
                    knob="chunking",
                    title=f"chunked prefill at a {b}-token budget"
                    if not chunked
                    else f"{'lower' if b < current else 'raise'} the chunk budget to {b}",
                    engine={"enable_chunked_prefill": True, "max_num_batched_tokens": b},
                    cost="a prompt longer than the budget takes one step per chunk, so its "
                    "TTFT grows by a step's overhead and a decode batch per extra chunk"
                    if b < max(facts.prompt_tokens, default=0)
                    else "a larger step beside the decodes: longer ITL spikes",
                )
            )
        if chunked:
            out.append(
                make(
                    "batch_budget_up",
                    id="chunk-off",
                    knob="chunking",
                    title="turn chunked prefill off",
                    engine={"enable_chunked_prefill": False},
                    cost="a long prompt is prefilled in one step that stalls every decode",
                )
            )
    if "max_num_seqs" in knobs:
        current = int(cfg.get("max_num_seqs") or 64)
        for n in seqs_grid(facts.peak_seqs, current):
            lever = "max_num_seqs_down" if n < current else "max_num_seqs_up"
            out.append(
                make(
                    lever,
                    id=f"seqs-{n}",
                    knob="max_num_seqs",
                    title=f"{'cap max_num_seqs at' if n < current else 'raise max_num_seqs to'} {n}",
                    engine={"max_num_seqs": n},
                    cost="requests wait in the queue instead of running (TTFT rises)"
                    if n < current
                    else "larger decode batches: every step takes longer (TPOT rises)",
                )
            )
    if "prefix_caching" in knobs:
        if cfg.get("enable_prefix_caching") is False:
            out.append(
                make(
                    "prefix_caching",
                    id="prefix-cache-on",
                    knob="prefix_caching",
                    title="turn prefix caching on",
                    engine={"enable_prefix_caching": True},
                    cost="hashing per KV block; cached blocks hold memory running requests "
                    "could use",
                )
            )
        else:
            knobs.add("kv_memory")  # on already: what it can still change is the room it has
    if "kv_memory" in knobs and cfg.get("num_kv_blocks"):
        blocks = int(cfg["num_kv_blocks"])
        gb = float(cfg.get("kv_cache_memory_gb") or 0.0)
        for f in KV_FACTORS:
            n = int(blocks * f)
            lever = (
                "prefix_caching"
                if "prefix_caching" in levers and "kv_memory" not in levers
                else "kv_memory"
            )
            out.append(
                make(
                    lever,
                    id=f"kv-x{f:g}",
                    knob="kv_memory",
                    title=f"a {f:g}x KV pool ({n} blocks)",
                    engine={"num_kv_blocks": n, "kv_cache_memory_gb": round(gb * f, 3)},
                    cost=f"{gb * (f - 1):.2g} GB more memory for the KV cache"
                    if gb
                    else f"{f:g}x the KV cache's memory",
                )
            )
    if "priorities" in knobs and len(facts.priorities) > 1:
        for cls in sorted(facts.priorities):
            prio = {c: 0 if c == cls else 1 for c in facts.priorities}
            if prio == facts.priorities:
                continue
            out.append(
                Candidate(
                    id=f"first-{cls}",
                    knob="priorities",
                    lever="priorities",
                    title=f"serve {cls} first (priority 0, the others 1)",
                    priorities=prio,
                    findings=tuple(f.id for f in levers.get("priorities", [])),
                    # the class's own objective where the user named one: a run that
                    # decides chat's TTFT mean may be too short to pin down its p95
                    target=objective if objective[0] == cls else (cls, "ttft_p95"),
                    cost="the other classes wait behind it, and are the ones preempted",
                    complexity=LEVERS["priorities"].complexity,
                    operates=LEVERS["priorities"].operates,
                    because=because("priorities", "priorities"),
                )
            )
    if "speculation" in knobs:
        if facts.speculated or facts.probed_acceptance is not None:
            spec_now = cfg.get("speculative_config") or {}
            for k in SPEC_K:
                if spec_now.get("num_speculative_tokens") == k:
                    continue
                out.append(
                    make(
                        "speculative_decoding",
                        id=f"ngram-{k}",
                        knob="speculation",
                        title=f"n-gram speculation with {k} drafts",
                        engine={
                            "speculative_config": {
                                **spec_now,
                                "method": "ngram",
                                "num_speculative_tokens": k,
                            }
                        },
                        cost="each verified draft is a row of the step's matmuls; rejected "
                        "drafts are work thrown away",
                    )
                )
            if facts.speculated:
                out.append(
                    make(
                        "speculative_decoding",
                        id="ngram-off",
                        knob="speculation",
                        title="turn speculation off",
                        engine={"speculative_config": None},
                        cost="one token per step again",
                    )
                )
        else:
            skipped.append(
                Unpredicted(
                    "speculative_decoding",
                    tuple(f.id for f in levers.get("speculative_decoding", [])),
                    "acceptance is unknown for this traffic: the run did not speculate, "
                    "and how many n-gram drafts are accepted depends on the text and the "
                    "sampling; measure it with one run under --speculative-config "
                    '\'{"method": "ngram", "num_speculative_tokens": 4}\' and tune that run',
                )
            )
    if "replicas" in knobs:
        for n in REPLICAS:
            out.append(
                make(
                    "capacity",
                    id=f"replicas-{n}",
                    knob="replicas",
                    title=f"{n} replicas behind a round-robin router",
                    replicas=n,
                    cost=f"{n}x the hardware (each replica a machine like this one)",
                )
            )
    for lever, found in levers.items():
        if LEVERS[lever].unpredicted:
            skipped.append(
                Unpredicted(lever, tuple(f.id for f in found), LEVERS[lever].unpredicted)
            )
    if "chunking" in shape and "disaggregation" not in levers:
        skipped.append(Unpredicted("disaggregation", (), LEVERS["disaggregation"].unpredicted))
    return _within_budget(out + pairs(out), called, skipped)


def _within_budget(
    cands: list[Candidate], called: set[str], skipped: list[Unpredicted]
) -> tuple[list[Candidate], list[Unpredicted]]:
    """The first ``SEARCH_BUDGET`` candidates, those of knobs a finding calls for first, then
    their pairs; the rest are named, per lever, among the unpredicted."""
    # stable: the grid's order kept, finding's knobs first, then their pairs, then the shape's
    ordered = sorted(cands, key=lambda c: 0 if c.knob in called else 1 if c.parts > 1 else 2)
    keep, over = ordered[:SEARCH_BUDGET], ordered[SEARCH_BUDGET:]
    left: dict[str, list[Candidate]] = {}
    for c in over:
        left.setdefault(c.lever, []).append(c)
    for lever, cs in left.items():
        skipped.append(
            Unpredicted(
                lever,
                cs[0].findings,
                f"not simulated: beyond the search budget of {SEARCH_BUDGET} candidates "
                f"({', '.join(c.id for c in cs)})",
            )
        )
    kept = {c.id for c in keep}
    return [c for c in cands if c.id in kept], skipped
