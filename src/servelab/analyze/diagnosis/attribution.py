"""Per-request attribution: where each request's TTFT went, and what caused each ITL stall.

TTFT from the intended send splits into parts that add up exactly:

    ttft_intended = client_lag + connection + sending + network_http + queue + prefill
                    + interference + preemption + overhead

- client_lag: intended -> actual send (the client's own lateness).
- connection, sending (another server only; the client's own clock): actual send -> a
  connection to send on (a new one's DNS, connect and TLS; ~0 on a kept-alive one), then
  -> the request's last byte written. A servelab target's exact split leaves them inside
  network_http, as it always has.
- network_http: client TTFT minus the server's arrival -> first token (HTTP, parsing,
  tokenisation, IPC and delivery of the first chunk, both ways), less connection and
  sending where those are split out.
- queue: arrival -> first admission.
- prefill: this request's share of the engine steps that computed its prompt.
- interference: the rest of those steps (other requests' prefill and decode in the same
  batch) and steps it sat out while admitted.
- preemption: waiting again after a preemption, and the work thrown away by it.
- overhead: gaps between engine steps while admitted (scheduling, sampling, detokenising).

``source`` says how the figures were obtained: "exact" (server timelines and steps of
a servelab target), "summary" (only the phase summary the server returned: interference
stays inside prefill), "reported" (another server's per-request figures, e.g. vLLM's
``metrics``: queue and prefill as it measured them, interference inside prefill; without
a queue figure, as from llama.cpp, queueing stays inside network_http), or "client"
(another server without them: only client_lag is per request; see promscrape for
run-level estimates).
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from servelab.analyze.gaps import Gaps, run_gaps
from servelab.analyze.server_side.promscrape import parse_scrapes
from servelab.analyze.server_side.timeseries import KV_PRESSURE, ServerSeries, server_series
from servelab.analyze.stats import FittedStepCost, fit_step_cost
from servelab.rundir import Run
from servelab.vocab import DECODE_ROLE, ClientRecord, RequestTimeline, StepRecord

# A gap is a stall when it exceeds the request's median gap by this factor and by
# STALL_MIN_EXCESS seconds (the floor keeps scheduler jitter on fast servers out).
STALL_FACTOR = 3.0
STALL_MIN_EXCESS = 0.010
MIN_GAPS_FOR_STALLS = 4

TTFT_PARTS = (
    "client_lag",
    "connection",
    "sending",
    "network_http",
    "queue",
    "prefill",
    "interference",
    "preemption",
    "overhead",
)
# The client's own connection and sending times: split out of network_http for other servers
# only; a servelab target's exact split (EXACT_PARTS) keeps them inside it.
CLIENT_PARTS = ("connection", "sending")
EXACT_PARTS = tuple(p for p in TTFT_PARTS if p not in CLIENT_PARTS)


@dataclass
class TTFTBreakdown:
    request_id: str
    workload_class: str
    input_tokens: int
    ttft: float  # actual send -> first token chunk
    client_lag: float
    connection: float | None = None
    sending: float | None = None
    network_http: float | None = None
    queue: float | None = None
    prefill: float | None = None
    interference: float | None = None
    preemption: float | None = None
    overhead: float | None = None
    cached_tokens: int = 0
    cache_saved: float | None = None  # estimated prefill seconds the prefix cache saved
    queue_depth: int = 0  # requests ahead in the waiting queue at arrival
    queue_reason: str | None = None  # "kv" | "max_num_seqs" | "budget" while it waited
    source: str = "client"

    def parts(self) -> dict[str, float]:
        """The known parts of ttft_intended (missing ones omitted)."""
        return {k: getattr(self, k) for k in TTFT_PARTS if getattr(self, k) is not None}

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in _BREAKDOWN_FIELDS}  # all scalars


@dataclass(kw_only=True)
class Stall:
    request_id: str
    workload_class: str
    at: float  # client time of the chunk before the gap
    gap: float
    median_gap: float
    cause: str  # prefill | preemption | batch_growth | client | server | unknown
    detail: str = ""
    server_gap: float | None = None
    evidence: dict = field(default_factory=dict)
    confidence: float = 1.0  # how sure the cause is: 1 from server steps, lower when inferred
    exact: bool = True  # False: inferred from the client's view and the /metrics series

    @property
    def excess(self) -> float:
        return self.gap - self.median_gap

    def to_dict(self) -> dict:
        """What ``asdict`` gives, and the excess: the evidence copied as plain JSON values
        (``asdict`` deep-copies every value and takes seconds on a run's 100k stalls)."""
        out = {name: getattr(self, name) for name in _STALL_FIELDS}
        out["evidence"] = _copied(self.evidence)
        return out | {"excess": self.excess}


def _copied(x: Any) -> Any:
    """A copy of nested dicts, lists and tuples of immutable values."""
    if isinstance(x, dict):
        return {k: _copied(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_copied(v) for v in x)
    return x


_BREAKDOWN_FIELDS = tuple(f.name for f in fields(TTFTBreakdown))
_STALL_FIELDS = tuple(f.name for f in fields(Stall))


@dataclass(kw_only=True)
class Attribution:
    ttft: list[TTFTBreakdown]
    stalls: list[Stall]
    cost: FittedStepCost | None
    source: str


class _StepIndex:
    """Steps sorted by start, with lookups by time and by request."""

    def __init__(self, steps: list[StepRecord]):
        self.steps = steps
        self.starts = [s.start for s in steps]
        self.ends = [s.end for s in steps]
        self.decode_batches: dict[str, list[int]] = {}
        for s in steps:
            for rid in s.decode:
                self.decode_batches.setdefault(rid, []).append(s.decode_seqs)

    def overlapping(self, a: float, b: float) -> list[StepRecord]:
        lo = bisect.bisect_right(self.ends, a)
        hi = bisect.bisect_left(self.starts, b)
        return self.steps[lo:hi]

    def ending_in(self, a: float, b: float, eps: float = 1e-9) -> list[StepRecord]:
        """Steps that ended in (a, b]: the work done between two token emissions."""
        lo = bisect.bisect_right(self.ends, a + eps)
        hi = bisect.bisect_right(self.ends, b + eps)
        return self.steps[lo:hi]

    def at(self, t: float) -> StepRecord | None:
        i = bisect.bisect_right(self.starts, t) - 1
        return self.steps[i] if i >= 0 else None


_NO_STEPS = _StepIndex([])


class _Engines:
    """One ``_StepIndex`` per engine of the deployment, keyed by ``(role, replica)``.

    Replicas and disaggregated workers run steps at the same times; a request is read only
    against the steps of the engine that ran its phase: its prefill (and queueing) on the
    engine that admitted it, its decode on the decode engine that took it over, if any.
    """

    def __init__(self, steps: list[StepRecord]):
        by_engine: dict[tuple[str, int], list[StepRecord]] = {}
        for s in steps:
            by_engine.setdefault((s.role, s.replica), []).append(s)
        self._index = {k: _StepIndex(v) for k, v in by_engine.items()}

    def prefill(self, tl: RequestTimeline) -> _StepIndex:
        return self._index.get((tl.role, tl.replica), _NO_STEPS)

    def decode(self, tl: RequestTimeline) -> _StepIndex:
        if tl.decode_replica is None:
            return self.prefill(tl)
        return self._index.get((DECODE_ROLE, tl.decode_replica), _NO_STEPS)


def attribute(run: Run) -> Attribution:
    """Attribute TTFT and ITL stalls for every successful streamed request of ``run``."""
    engines = _Engines(run.steps)
    cost = fit_step_cost(run.steps)
    max_seqs = run.engine_config.get("max_num_seqs")
    ok = [r for r in run.records if r.ok and r.chunk_times]
    breakdowns = []
    for rec in ok:
        tl = run.timeline_for(rec)
        if tl is not None and tl.first_token is not None and tl.scheduled and run.steps:
            breakdowns.append(_exact(rec, tl, engines.prefill(tl), cost, max_seqs))
        elif _summary_usable(rec):
            breakdowns.append(_from_summary(rec))
        else:
            breakdowns.append(_client_split(_base(rec), rec))  # client-side figures only
    _fill_queue_depth(run, ok, breakdowns)
    stalls = []
    series = server_series(parse_scrapes(run.scrapes)) if not run.timelines else None
    if series is not None:
        _reported_queue_reasons(ok, breakdowns, series)
    windows = _Windows(ok)
    gaps = run_gaps(run)
    for i, rec_gaps, med, at in _stall_gaps(run.records, gaps):
        rec = run.records[i]
        tl = run.timeline_for(rec)
        if tl is not None and run.steps:
            idx = engines.decode(tl)
        else:
            tl, idx = None, _NO_STEPS
        stalls.extend(_stalls(rec, rec_gaps, med, at, tl, idx, cost, windows, series))
    sources = {b.source for b in breakdowns}
    source = sources.pop() if len(sources) == 1 else ("mixed" if sources else "none")
    return Attribution(ttft=breakdowns, stalls=stalls, cost=cost, source=source)


def _base(rec: ClientRecord) -> TTFTBreakdown:
    return TTFTBreakdown(
        request_id=rec.request_id,
        workload_class=rec.workload_class,
        input_tokens=rec.input_tokens,
        ttft=rec.ttft or 0.0,
        client_lag=rec.send_lag,
    )


def _summary_usable(rec: ClientRecord) -> bool:
    s = rec.server_timeline or {}
    if "reported_by" in s:  # another server's figures: a queue figure is optional
        return s.get("prefill_time") is not None and rec.stream
    return s.get("queue_time") is not None and s.get("prefill_time") is not None


def _from_summary(rec: ClientRecord) -> TTFTBreakdown:
    s = rec.server_timeline or {}
    b = _base(rec)
    q = s.get("queue_time")
    b.queue = float(q) if q is not None else None
    b.prefill = float(s["prefill_time"])
    b.network_http = b.ttft - (b.queue or 0.0) - b.prefill
    b.cached_tokens = int(s.get("cached_prompt_tokens") or 0)
    b.source = "reported" if "reported_by" in s else "summary"
    if b.source == "reported":
        _client_split(b, rec)
        b.network_http -= (b.connection or 0.0) + (b.sending or 0.0)
    return b


def _client_split(b: TTFTBreakdown, rec: ClientRecord) -> TTFTBreakdown:
    """Another server's request: the client's own connection and sending times (None in runs
    recorded before the client kept them)."""
    b.connection, b.sending = rec.connection_wait, rec.send_time
    return b


def _exact(
    rec: ClientRecord,
    tl: RequestTimeline,
    idx: _StepIndex,
    cost: FittedStepCost | None,
    max_seqs: int | None,
) -> TTFTBreakdown:
    b = _base(rec)
    b.source = "exact"
    ft = tl.first_token
    assert ft is not None
    b.network_http = b.ttft - (ft - tl.arrival)
    parts = dict.fromkeys(("queue", "prefill", "interference", "preemption", "overhead"), 0.0)
    admissions = [s for s in tl.scheduled if s < ft]
    reasons: dict[str, float] = {}
    for k, adm in enumerate(admissions):
        entered = tl.queued[k] if k < len(tl.queued) else adm
        parts["queue" if k == 0 else "preemption"] += adm - entered
        if k == 0:
            _queue_reasons(idx, entered, adm, max_seqs, reasons)
        ends_in_preemption = k < len(admissions) - 1
        stop = tl.preemptions[k] if ends_in_preemption and k < len(tl.preemptions) else ft
        if ends_in_preemption:
            parts["preemption"] += stop - adm
            continue
        _split_admitted(tl.request_id, adm, stop, idx, cost, parts)
    for part, seconds in parts.items():
        setattr(b, part, seconds)
    b.cached_tokens = tl.cached_tokens
    if cost is not None:
        b.cache_saved = tl.cached_tokens * cost.prefill_per_token
    if reasons:
        b.queue_reason = max(reasons, key=reasons.__getitem__)
    return b


def _split_admitted(
    rid: str,
    a: float,
    b: float,
    idx: _StepIndex,
    cost: FittedStepCost | None,
    parts: dict[str, float],
) -> None:
    """Split [a, b] (admitted, before the first token) into prefill, interference, overhead."""
    covered = 0.0
    for s in idx.overlapping(a, b):
        ov = min(s.end, b) - max(s.start, a)
        if ov <= 0:
            continue
        covered += ov
        own = s.prefill.get(rid, 0)
        if not own:
            parts["interference"] += ov
            continue
        share = _own_share(own, s, cost)
        parts["prefill"] += ov * share
        parts["interference"] += ov * (1.0 - share)
    parts["overhead"] += max(0.0, (b - a) - covered)


def _own_share(own_tokens: int, s: StepRecord, cost: FittedStepCost | None) -> float:
    """This request's fraction of a step's time, by the cost model (else by tokens)."""
    tokens = s.prefill_tokens + s.decode_seqs
    if tokens <= 0:
        return 1.0
    if cost is None:
        return own_tokens / tokens
    total = cost.predict(s.prefill_tokens, s.decode_seqs)
    if total <= 0:
        return own_tokens / tokens
    own = cost.prefill_per_token * own_tokens + cost.overhead * own_tokens / tokens
    return min(1.0, own / total)


def _queue_reasons(
    idx: _StepIndex, a: float, b: float, max_seqs: int | None, acc: dict[str, float]
) -> None:
    """Why the queue did not move during [a, b]: KV full, sequence cap, or token budget."""
    for s in idx.overlapping(a, b):
        ov = min(s.end, b) - max(s.start, a)
        if ov <= 0:
            continue
        running = len(s.decode) + len(s.prefill)
        if s.preempted or (s.kv_blocks_total and s.kv_blocks_used >= 0.9 * s.kv_blocks_total):
            reason = "kv"
        elif max_seqs and running >= max_seqs:
            reason = "max_num_seqs"
        else:
            reason = "budget"
        acc[reason] = acc.get(reason, 0.0) + ov


def _reported_queue_reasons(
    ok: list[ClientRecord], out: list[TTFTBreakdown], series: ServerSeries
) -> None:
    """Why another server kept a request queued, from the /metrics series: "kv" when its
    KV cache was nearly full or it preempted during the wait (so kv_pressure, not
    queue_bound, explains the wait), else "other". The wait is placed from the server's own
    queue and prefill figures, counted back from the first token."""
    for r, b in zip(ok, out):
        if b.source != "reported" or not b.queue:
            continue
        scheduled = r.chunk_times[0] - (b.prefill or 0.0)
        a = scheduled - b.queue
        kv = series.peak("kv_usage", a, scheduled)
        full = kv is not None and kv >= KV_PRESSURE
        b.queue_reason = (
            "kv" if full or series.rose_during("preemptions", a, scheduled) else "other"
        )


def _fill_queue_depth(run: Run, ok: list[ClientRecord], out: list[TTFTBreakdown]) -> None:
    """Queue depth at arrival: requests waiting (server timelines, or the server's reported
    queue figures) or awaiting a first token (client).

    A span (enter, leave) contains t when enter < t < leave; since enter <= leave, that
    count is #(enter < t) - #(leave < t), up to spans leaving exactly at t.
    """
    if run.timelines:
        tls = [run.timeline_for(r) for r in ok]
        spans = [(t.arrival, t.scheduled[0]) for t in tls if t is not None and t.scheduled]
        at = [t.arrival if t is not None else None for t in tls]
    elif all(b.source == "reported" and b.queue is not None for b in out):
        # The server's own figures place each wait: [queued, scheduled], counted back from
        # the first token, which is closer to the server's queue than the client's in-flight.
        spans = []
        for r, b in zip(ok, out):
            scheduled = r.chunk_times[0] - (b.prefill or 0.0)
            spans.append((scheduled - (b.queue or 0.0), scheduled))
        at = [s for s, _ in spans]
    else:
        spans = [(r.actual_send, r.chunk_times[0]) for r in ok]
        at = [r.actual_send for r in ok]
    enters = sorted(s for s, _ in spans)
    leaves = sorted(e for _, e in spans)
    for b, t in zip(out, at):
        if t is not None:
            b.queue_depth = bisect.bisect_left(enters, t) - bisect.bisect_left(leaves, t)


def _stall_gaps(
    records: list[ClientRecord], gaps: Gaps
) -> Iterator[tuple[int, list[float], float, list[int]]]:
    """(record index, its gaps, their median, the indices of the gaps that are stalls)
    for each successful streamed record with a stall, in record order.

    A gap is a stall when it exceeds ``STALL_FACTOR`` x the request's median and the
    median by ``STALL_MIN_EXCESS``; the test runs on every gap of the run at once."""
    counts = gaps.counts
    med = np.full(len(records), np.nan)
    for i, r in enumerate(records):
        if r.ok and counts[i] >= MIN_GAPS_FOR_STALLS:
            med[i] = statistics.median(gaps.of_record(i))
    found = []
    for a, b in gaps.blocks():
        g = gaps.values[gaps.offsets[a] : gaps.offsets[b]]
        per_gap = np.repeat(med[a:b], counts[a:b])
        stall = (g > STALL_FACTOR * per_gap) & (g - per_gap > STALL_MIN_EXCESS)
        found.append(np.flatnonzero(stall) + gaps.offsets[a])
    pos = np.concatenate(found) if found else np.zeros(0, np.int64)
    owner = np.searchsorted(gaps.offsets, pos, "right") - 1
    local = pos - gaps.offsets[owner]
    bounds = np.flatnonzero(np.diff(owner, prepend=-1, append=len(records)))
    for lo, hi in itertools.pairwise(bounds.tolist()):
        i = int(owner[lo])
        yield i, gaps.of_record(i), float(med[i]), local[lo:hi].tolist()


def _stalls(
    rec: ClientRecord,
    gaps: list[float],
    med: float,
    at: list[int],
    tl: RequestTimeline | None,
    idx: _StepIndex,
    cost: FittedStepCost | None,
    windows: _Windows,
    series: ServerSeries | None,
) -> list[Stall]:
    """The stalls of one request: ``gaps[i]`` for ``i`` in ``at``, with their causes."""
    out = []
    matched = False
    cum: list[int] = []
    if tl is not None:
        cum = list(itertools.accumulate(rec.chunk_tokens or [1] * len(rec.chunk_times)))
        matched = len(tl.token_times) == (cum[-1] if cum else 0)
    # Counts disagree (e.g. a stop string trimmed): map client times to server times by
    # the first token's delivery delay instead of by token index.
    offset = rec.chunk_times[0] - tl.first_token if tl is not None and tl.first_token else None
    for i in at:
        g = gaps[i]
        stall = Stall(
            request_id=rec.request_id,
            workload_class=rec.workload_class,
            at=rec.chunk_times[i],
            gap=g,
            median_gap=med,
            cause="unknown",
        )
        if tl is not None and matched:
            sa, sb = tl.token_times[cum[i] - 1], tl.token_times[cum[i + 1] - 1]
            stall.server_gap = sb - sa
            if g - stall.server_gap > 0.5 * (g - med):
                stall.cause = "client"
                stall.detail = (
                    f"the server sent the token {stall.server_gap * 1e3:.0f} ms after the "
                    f"previous one; it reached the client {g * 1e3:.0f} ms after"
                )
            else:
                _server_cause(stall, rec.request_id, tl, sa, sb, idx, cost, med)
        elif tl is not None and offset is not None:
            sa, sb = rec.chunk_times[i] - offset, rec.chunk_times[i + 1] - offset
            _server_cause(stall, rec.request_id, tl, sa, sb, idx, cost, med)
        elif tl is None:
            stall.exact = False
            _estimate_cause(stall, rec, gaps, i, windows, series)
        out.append(stall)
    return out


def _server_cause(
    stall: Stall,
    rid: str,
    tl: RequestTimeline,
    sa: float,
    sb: float,
    idx: _StepIndex,
    cost: FittedStepCost | None,
    med: float,
) -> None:
    steps = idx.ending_in(sa, sb)
    excess = (stall.server_gap or stall.gap) - med
    if any(sa < p <= sb for p in tl.preemptions) or any(rid in s.preempted for s in steps):
        stall.cause = "preemption"
        stall.detail = "the request was preempted and its KV cache recomputed"
        return
    foreign: dict[str, int] = {}
    for s in steps:
        for other, n in s.prefill.items():
            if other != rid:
                foreign[other] = foreign.get(other, 0) + n
    ptok = sum(foreign.values())
    prefill_time = cost.prefill_per_token * ptok if cost else None
    stall.evidence = {"steps": len(steps), "prefill_tokens": ptok}
    if ptok and (prefill_time is None or prefill_time >= 0.5 * excess):
        top = max(foreign, key=foreign.__getitem__)
        stall.cause = "prefill"
        stall.detail = f"co-scheduled with {ptok} prefill tokens ({top}: {foreign[top]})"
        if prefill_time is not None:
            stall.evidence["prefill_seconds"] = prefill_time
        return
    usual = statistics.median(idx.decode_batches.get(rid) or [1])
    batch = max((s.decode_seqs for s in steps), default=0)
    stall.evidence["decode_batch"] = batch
    stall.evidence["usual_decode_batch"] = usual
    if batch >= 1.5 * usual and (
        cost is None or cost.decode_per_seq * (batch - usual) >= 0.5 * excess
    ):
        stall.cause = "batch_growth"
        stall.detail = f"the decode batch grew from {usual:.0f} to {batch} sequences"
        return
    stall.cause = "server"
    stall.detail = f"{len(steps)} engine step(s) with no prefill or batch growth to explain it"


_Window = tuple[float, float, ClientRecord, bool]  # (start, first token, record, reported)


class _Windows:
    """Every other request's prefill window as the client saw it: from its send (or, with
    the server's figures, from its send plus queue time) to its first token.

    Rows are sorted by first token. The long prompts' rows are also kept apart with the
    longest window among them, so that the windows covering an instant are found by
    bisecting first tokens instead of scanning every request."""

    def __init__(self, ok: list[ClientRecord]):
        self.rows: list[_Window] = []
        for r in ok:
            s = r.server_timeline or {}
            prefill = s.get("prefill_time") if "reported_by" in s else None
            start = r.chunk_times[0] - prefill if prefill is not None else r.actual_send
            self.rows.append((start, r.chunk_times[0], r, prefill is not None))
        self.rows.sort(key=lambda x: x[1])
        self.firsts = [x[1] for x in self.rows]
        inputs = sorted(r.input_tokens for r in ok)
        self.typical_input = inputs[len(inputs) // 2] if inputs else 0
        cut = LONG_PROMPT * max(self.typical_input, 1)
        self.long = [x for x in self.rows if x[2].input_tokens >= cut]
        self.long_firsts = [x[1] for x in self.long]
        # A window that starts before b ends before b + the longest window; the margin
        # covers the rounding of first - start.
        self.long_reach = max((x[1] - x[0] for x in self.long), default=0.0)

    def first_tokens_in(self, a: float, b: float) -> list[_Window]:
        lo, hi = bisect.bisect_left(self.firsts, a), bisect.bisect_right(self.firsts, b)
        return self.rows[lo:hi]

    def long_in_prefill(self, a: float, b: float) -> list[_Window]:
        """The long prompts (``LONG_PROMPT`` x the typical input) whose window overlaps
        (a, b): first token after a, start before b; in first-token order."""
        lo = bisect.bisect_right(self.long_firsts, a)
        bound = b + self.long_reach
        hi = bisect.bisect_right(self.long_firsts, bound + 1e-6 * (1.0 + abs(bound)))
        return [x for x in self.long[lo:hi] if x[0] < b]


# Confidence of each inferred cause (no server steps): a stall that ends as another
# request's first token arrives, while that request's prefill covered it, is strong
# evidence; a long prompt merely in flight is weaker; the series has the scrape
# interval's resolution.
# A prompt this many times the run's typical input is one other requests wait behind.
LONG_PROMPT = 4
CONF_PREFILL_ENDS = 0.75
CONF_PREFILL_REPORTED = 0.85  # the other request's prefill window is the server's figure
CONF_PREFILL_OVERLAP = 0.4
CONF_PREFILL_WAITED = 0.5  # a short prompt that waited through the whole gap
CONF_PREEMPTION = 0.6
CONF_KV = 0.35
CONF_CLIENT = 0.5


def _estimate_cause(
    stall: Stall,
    rec: ClientRecord,
    gaps: list[float],
    i: int,
    windows: _Windows,
    series: ServerSeries | None,
) -> None:
    """No server timeline: infer the cause from the other requests' windows and the series.

    In order: another request's prefill whose first token ends the stall (and whose prefill
    window covers it); a long prompt in prefill during the gap; a preemption counted in the
    gap's scrape interval; a KV cache near full; a short prompt that waited through the gap
    and whose first token ends it, unless the next token follows at once; tokens
    that piled up and arrived together (the network or the client held them). Each sets a
    confidence and its evidence.
    """
    a, b = stall.at, stall.at + stall.gap
    slack = max(2 * stall.median_gap, 0.005)
    after = gaps[i + 1 : i + 4]
    # A short prompt's first token often lands at the end of a gap by chance: only a
    # prefill long enough to explain the excess (by the server's figure), or a prompt well
    # above the typical one, counts.
    ends = [
        x
        for x in windows.first_tokens_in(a, b + slack)
        if x[2] is not rec
        and x[0] < b
        and (
            (x[3] and x[1] - x[0] >= 0.5 * stall.excess)
            or x[2].input_tokens >= 2 * max(windows.typical_input, 1)
        )
    ]
    if ends:
        start, first, o, reported = max(ends, key=lambda x: x[2].input_tokens)
        _blame_prefill(
            stall, o, start, first, CONF_PREFILL_REPORTED if reported else CONF_PREFILL_ENDS
        )
        stall.evidence["ended_by_first_token_of"] = o.request_id
        return
    long = [x for x in windows.long_in_prefill(a, b) if x[2] is not rec]
    if long:
        start, first, o, _ = max(long, key=lambda x: x[2].input_tokens)
        _blame_prefill(stall, o, start, first, CONF_PREFILL_OVERLAP)
        return
    if series is not None:
        if (n := series.rose_during("preemptions", a, b)) > 0:
            stall.cause, stall.confidence = "preemption", CONF_PREEMPTION
            stall.detail = f"the server counted {n:.0f} preemption(s) in this interval (/metrics)"
            stall.evidence = {"preemptions": n, "scrape_interval_s": series.interval}
            return
        kv = series.peak("kv_usage", a, b)
        if kv is not None and kv >= KV_PRESSURE:
            stall.cause, stall.confidence = "kv_pressure", CONF_KV
            stall.detail = f"the KV cache was {kv:.0%} full during the gap (/metrics)"
            stall.evidence = {"kv_usage": kv, "waiting": series.peak("waiting", a, b)}
            return
    # A short prompt sent before the gap began waited through all of it; if its first token
    # came with the one that ended the gap, that step ran (the last of) its prefill; unless the next
    # token follows at once, which says the tokens were held on the way. Weaker than the
    # series: with the KV cache full, a queued request is admitted as another is preempted,
    # and its first token then ends that request's gap without its prefill being the cause.
    waited = [
        x
        for x in windows.first_tokens_in(b - slack, b + slack)
        if x[2] is not rec and x[2].actual_send <= a
    ]
    if waited and not (after and after[0] < 0.25 * stall.median_gap):
        start, first, o, _ = max(waited, key=lambda x: x[2].input_tokens)
        _blame_prefill(stall, o, start, first, CONF_PREFILL_WAITED)
        stall.evidence["ended_by_first_token_of"] = o.request_id
        return
    if len(after) >= 2 and max(after) < 0.25 * stall.median_gap:
        stall.cause, stall.confidence = "client", CONF_CLIENT
        stall.detail = (
            f"the next {len(after)} tokens arrived together right after the gap: they were "
            "held on the way (network or client), not late from the server"
        )
        stall.evidence = {"gaps_after_ms": [round(g * 1e3, 2) for g in after]}


def _blame_prefill(
    stall: Stall, o: ClientRecord, start: float, first: float, confidence: float
) -> None:
    stall.cause, stall.confidence = "prefill", confidence
    stall.detail = (
        f"{o.request_id} ({o.input_tokens} prompt tokens) was in prefill during the gap "
        "(inferred from client times)"
    )
    stall.evidence = {
        "request": o.request_id,
        "prompt_tokens": o.input_tokens,
        "prefill_window": [start, first],
    }
