"""Aggregate client records into the numbers a benchmark reports. Pure functions.

Public API (the benchmark, the analysis commands and the simulator call these):

- ``SLO`` / ``SLO.parse("ttft=2s,itl=250ms")``: per-request latency limits; ``slo.met(record)``.
- ``Trim.parse("10s" | "20" | "5%")``: a warm-up or cool-down exclusion rule.
- ``measured_window(records, warmup, cooldown) -> Window``: the measured time window.
- ``summarize(records, slos=..., warmup=..., cooldown=...) -> dict``: the whole ``metrics.json``
  body: window, counts, and for ``overall`` / ``by_class`` / ``by_input_bucket`` the throughput,
  goodput and latency statistics.

Definitions (docs/design/overview.md "Metrics"; docs/metrics.md says which peer each one matches):

- Latency metrics come from ``ClientRecord`` properties: ``ttft``, ``ttft_intended``, ``itl``
  (pooled gaps between token-bearing chunks), ``tpot``, ``e2e``. Only successful requests
  contribute latencies; failed ones are counted separately and never meet an SLO.
- The *measured window* is ``[start, end]``: by default from the first actual send to the last
  byte; warm-up moves ``start`` later, cool-down moves ``end`` earlier. Latency statistics and
  goodput fractions use the requests *sent* inside the window; rates (requests/s, tokens/s,
  goodput/s) count *events* inside the window (completions, and output tokens by the arrival
  time of the chunk that carried them) divided by the window's length. Output tokens/s counts
  successful requests only (as vLLM and GuideLLM do); ``failed_output_tokens_per_s`` beside it
  counts what failed, cut and timed-out requests streamed.
- Percentile point estimates use numpy's default (linear interpolation, as vLLM does), with
  the confidence intervals of ``analyze.stats.describe`` (pooled ITL resampled by request).
"""

from __future__ import annotations

import bisect
import copy
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from servelab.analyze.gaps import Gaps
from servelab.analyze.server_side.timeseries import ServerSeries
from servelab.analyze.similarity import cache_hit_rate
from servelab.analyze.stats import DEFAULT_CONFIDENCE, DEFAULT_N_BOOT, describe
from servelab.analyze.timeslices import DEFAULT_SLICE_DURATION, timeslices
from servelab.rundir import Run
from servelab.units import SLO, Trim
from servelab.vocab import LATENCY_METRICS, ClientRecord

DEFAULT_BUCKET_EDGES: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True, kw_only=True)
class Window:
    """The measured window ``[start, end]`` (monotonic seconds) and how it was chosen."""

    start: float
    end: float
    warmup: str = "none"
    cooldown: str = "none"

    @property
    def duration(self) -> float:
        return max(0.0, self.end - self.start)

    def contains(self, t: float | None) -> bool:
        return t is not None and self.start <= t <= self.end

    def to_dict(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "end": self.end,
            "duration_s": self.duration,
            "warmup": self.warmup,
            "cooldown": self.cooldown,
            "rule": "latencies and fractions: requests sent in the window; "
            "rates: completions and output tokens that arrived in the window / its length",
        }


def _last_time(r: ClientRecord) -> float:
    if r.done is not None:
        return r.done
    if r.chunk_times:
        return r.chunk_times[-1]
    return r.actual_send


def measured_window(
    records: Sequence[ClientRecord],
    warmup: Trim | str | None = None,
    cooldown: Trim | str | None = None,
) -> Window:
    """The window from the first send to the last byte, less warm-up and cool-down.

    ``requests``/``percent`` rules move the start to the send time of the first request
    kept, and the end to the send time of the first request dropped at the tail (so the
    drain after the last kept send is excluded too). Raises ValueError when nothing is left.
    """
    if not records:
        raise ValueError("no client records to summarise: did any request get sent?")
    w = warmup if isinstance(warmup, Trim) else Trim.parse(warmup)
    c = cooldown if isinstance(cooldown, Trim) else Trim.parse(cooldown)
    sends = sorted(r.actual_send for r in records)
    start, end = sends[0], max(_last_time(r) for r in records)
    n = len(sends)

    def count(t: Trim) -> int:
        return int(t.value) if t.kind == "requests" else math.floor(n * t.value / 100.0)

    if w.kind == "seconds":
        start += w.value
    elif w.kind in ("requests", "percent"):
        k = count(w)
        if k >= n:
            raise ValueError(f"warm-up {w.describe()} excludes all {n} requests; use a smaller one")
        start = sends[k]
    if c.kind == "seconds":
        end -= c.value
    elif c.kind in ("requests", "percent"):
        k = count(c)
        if k > 0:
            if k >= n:
                raise ValueError(f"cool-down {c.describe()} excludes all {n} requests")
            end = sends[n - k]
    if end <= start:
        raise ValueError(
            f"warm-up ({w.describe()}) and cool-down ({c.describe()}) leave no measured window "
            f"in a run whose sends span {sends[-1] - sends[0]:.3g}s; use smaller ones"
        )
    return Window(start=start, end=end, warmup=w.describe(), cooldown=c.describe())


# --------------------------------------------------------------------------- statistics


def bucket_label(input_tokens: int, edges: Sequence[int] = DEFAULT_BUCKET_EDGES) -> str:
    """The input-length bucket of a request, e.g. ``"512-1023"`` or ``">=8192"``."""
    lo = 0
    for hi in edges:
        if input_tokens < hi:
            return f"{lo}-{hi - 1}"
        lo = hi
    return f">={lo}"


def metric_values(
    records: Sequence[ClientRecord], metric: str
) -> tuple[list[float], list[int] | None]:
    """One metric's finite values over ``records``, and for ``itl`` (pooled gaps) the
    index of the request each gap belongs to, so resampling can move whole requests."""
    if metric == "itl":
        vals: list[float] = []
        grp: list[int] = []
        for i, r in enumerate(records):
            gaps = r.itls
            vals.extend(gaps)
            grp.extend([i] * len(gaps))
        return vals, grp
    values = (getattr(r, metric) for r in records)
    return [x for x in values if x is not None and math.isfinite(x)], None


def _tokens_in_window(r: ClientRecord, window: Window) -> float:
    """Output tokens of ``r`` that arrived inside the window (by the chunk that carried them)."""
    if r.chunk_times:
        # chunk_times are in arrival order, so the inside chunks are one slice
        i0 = bisect.bisect_left(r.chunk_times, window.start)
        i1 = bisect.bisect_right(r.chunk_times, window.end)
        if i1 <= i0:
            return 0.0
        if len(r.chunk_tokens) == len(r.chunk_times):
            total = sum(r.chunk_tokens)
            carried = total or len(r.chunk_times)
            # every chunk inside (most records): the same sum, not a copy summed again
            inside = total if i1 - i0 == len(r.chunk_times) else sum(r.chunk_tokens[i0:i1])
        else:
            carried, inside = len(r.chunk_times), i1 - i0
        scale = r.output_tokens / carried if r.output_tokens else 1.0
        return inside * scale
    return float(r.output_tokens) if window.contains(r.done) else 0.0


class _Columns:
    """What a summary reads of each record, read once for all its groups: whether it was
    sent and completed in the window, met its SLO, the output tokens that arrived in the
    window, each latency metric (NaN where absent) and the ITL gaps."""

    def __init__(
        self,
        records: Sequence[ClientRecord],
        window: Window,
        slo_of: Callable[[ClientRecord], SLO],
        gaps: Gaps | None = None,
    ) -> None:
        self.records = records
        self.window = window
        n = len(records)
        self.ok = np.fromiter((r.ok for r in records), bool, n)
        self.sent = np.fromiter((window.contains(r.actual_send) for r in records), bool, n)
        self.completed = self.ok & np.fromiter((window.contains(r.done) for r in records), bool, n)
        self.met = np.fromiter(
            (
                slo_of(r).met(r) if sent or done else False
                for r, sent, done in zip(records, self.sent, self.completed)
            ),
            bool,
            n,
        )
        self.tokens = [_tokens_in_window(r, window) for r in records]
        self.latency = {
            m: np.fromiter((_nan(getattr(r, m)) for r in records), np.float64, n)
            for m in LATENCY_METRICS
            if m != "itl"
        }
        self.gaps = gaps if gaps is not None else Gaps.of(records)

    def values(self, idx: np.ndarray, metric: str) -> tuple[np.ndarray, np.ndarray | None]:
        """``metric_values(records[idx], metric)`` for ascending ``idx``."""
        if metric == "itl":
            return self.gaps.pooled(idx)
        v = self.latency[metric][idx]
        return v[np.isfinite(v)], None

    def group(
        self, idx: np.ndarray, *, n_boot: int, seed: int, confidence: float
    ) -> dict[str, Any]:
        """``summarize_group`` of ``records[idx]`` (``idx`` ascending)."""
        recs = self.records
        sent = idx[self.sent[idx]]
        ok = sent[self.ok[sent]]
        completed = idx[self.completed[idx]]
        n_good = int(self.met[sent].sum())
        n_good_completed = int(self.met[completed].sum())
        dur = self.window.duration

        def rate(x: float) -> float | None:
            return x / dur if dur > 0 else None

        tokens = self.tokens
        served = self.ok[idx]  # output tokens/s counts successful requests' tokens only
        out_tokens = sum([tokens[i] for i in idx[served].tolist()])
        failed_out = sum([tokens[i] for i in idx[~served].tolist()])
        in_tokens = sum(recs[i].input_tokens for i in completed.tolist())
        latency = {}
        for metric in LATENCY_METRICS:
            vals, grp = self.values(ok, metric)
            latency[metric] = describe(
                vals, grp, confidence=confidence, n_boot=n_boot, seed=seed
            ).to_dict()
        ok_recs = [recs[i] for i in ok.tolist()]
        return {
            "requests": {
                "sent": len(sent),
                "ok": len(ok),
                "failed": len(sent) - len(ok),
                "errors": _error_kinds(recs[i] for i in sent.tolist()),
            },
            "throughput": {
                "requests_per_s": rate(len(completed)),
                "input_tokens_per_s": rate(in_tokens),
                "output_tokens_per_s": rate(out_tokens),
                "failed_output_tokens_per_s": rate(failed_out),
                "total_tokens_per_s": rate(in_tokens + out_tokens),
            },
            "goodput": {
                "requests_per_s": rate(n_good_completed),
                "fraction": (n_good / len(sent)) if len(sent) else None,
                "met": n_good,
            },
            "latency": latency,
            "reasoning_tokens": sum(r.reasoning_tokens for r in ok_recs),
            "prefix_cache_hit_rate": cache_hit_rate(
                (r.cached_tokens, r.input_tokens) for r in ok_recs
            ),
        }


def _nan(x: float | None) -> float:
    return math.nan if x is None else x


def summarize_group(
    records: Sequence[ClientRecord],
    window: Window,
    slo: SLO | dict[str, SLO] | Callable[[ClientRecord], SLO] | None = None,
    *,
    n_boot: int = DEFAULT_N_BOOT,
    seed: int = 0,
    confidence: float = DEFAULT_CONFIDENCE,
) -> dict[str, Any]:
    """Counts, throughput, goodput and latency statistics of one group of records.

    ``slo`` is one SLO for all records, ``{workload_class: SLO}``, or a function giving
    each record's SLO.
    """
    cols = _Columns(records, window, _slo_lookup(slo))
    return cols.group(np.arange(len(records)), n_boot=n_boot, seed=seed, confidence=confidence)


def _slo_lookup(
    slo: SLO | dict[str, SLO] | Callable[[ClientRecord], SLO] | None,
) -> Callable[[ClientRecord], SLO]:
    """Normalise "no SLO", one SLO, ``{class: SLO}`` or a function into a function."""
    if slo is None:
        none = SLO()  # one for all records, not one made per record
        return lambda r: none
    if isinstance(slo, SLO):
        return lambda r: slo
    if isinstance(slo, dict):
        return lambda r: slo.get(r.workload_class, SLO())
    return slo


def _error_kinds(records: Iterable[ClientRecord]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            kind = r.error.split(":", 1)[0]
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def token_checks(records: Sequence[ClientRecord]) -> dict[str, Any]:
    """Server-vs-client token count disagreements and whether exact output lengths held."""
    recount = [r for r in records if r.ok and r.client_output_tokens is not None]
    disagree = [r for r in recount if r.client_output_tokens != r.output_tokens]
    asked = [r for r in records if r.ok and r.requested_output_tokens is not None]
    short = [r for r in asked if r.output_tokens != r.requested_output_tokens]
    disputed = [r for r in records if r.disputed_usage is not None]
    return {
        "recounted": len(recount),
        "usage_vs_client_disagreements": len(disagree),
        "disagreement_examples": [
            {"request_id": r.request_id, "usage": r.output_tokens, "client": r.client_output_tokens}
            for r in disagree[:5]
        ],
        "usage_disputed": len(disputed),
        "disputed_examples": [
            {"request_id": r.request_id, "usage": r.disputed_usage, "counted": r.output_tokens}
            for r in disputed[:5]
        ],
        "output_length_requested": len(asked),
        "output_length_not_honoured": len(short),
        "token_source": _count_by(records, lambda r: r.token_source),
    }


def _count_by(
    records: Iterable[ClientRecord], key: Callable[[ClientRecord], str]
) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        k = key(r)
        out[k] = out.get(k, 0) + 1
    return out


@contextmanager
def _ordinary_pages() -> Iterator[None]:
    """numpy's arrays on ordinary pages for the duration (its setting restored after).

    numpy asks for transparent huge pages (``MADV_HUGEPAGE``) under every large array. A
    long run's summary makes and drops arrays of millions of gaps, each fresh from the
    allocator, and faulting each in as huge pages, with the kernel compacting memory to
    find them, took 0.3-0.7 s of system time summarizing a whole-trace simulated run on this
    machine (0.1-0.2 s on ordinary pages; docs/design/sim.md "Speed"). A numpy without
    the setting is left as it is.
    """
    core = getattr(np, "_core", None)
    set_huge = getattr(getattr(core, "multiarray", None), "_set_madvise_hugepage", None)
    if set_huge is None:
        yield
        return
    was = set_huge(False)
    try:
        yield
    finally:
        set_huge(was)


def summarize(
    records: Sequence[ClientRecord],
    *,
    slos: SLO | dict[str, SLO] | None = None,
    warmup: Trim | str | None = None,
    cooldown: Trim | str | None = None,
    window: Window | None = None,
    bucket_edges: Sequence[int] = DEFAULT_BUCKET_EDGES,
    n_boot: int = DEFAULT_N_BOOT,
    seed: int = 0,
    confidence: float = DEFAULT_CONFIDENCE,
    similarity: dict[str, Any] | None = None,
    slice_duration: float = DEFAULT_SLICE_DURATION,
    series: ServerSeries | None = None,
) -> dict[str, Any]:
    """The body of ``metrics.json`` for a set of client records.

    ``slos`` is one SLO for every request or ``{workload_class: SLO}`` (classes absent
    from the dict have no limits). ``window`` overrides ``warmup``/``cooldown``.
    ``similarity`` (``analyze.similarity.ideal_prefix_reuse`` of the prompts sent) puts
    ``prefix_reuse_ideal`` beside each group's measured ``prefix_cache_hit_rate``.

    ``timeslices`` holds per-window figures and the steady/over-saturated verdict
    (``analyze.timeslices``), the queue depth from ``series`` (the ``/metrics`` time
    series) where it has one, else from the client's in-flight count.

    Returns ``{"window", "counts", "tokens", "slos", "overall", "by_class",
    "by_input_bucket", "timeslices"}``; ``overall``, ``by_class`` and ``by_input_bucket``
    hold ``summarize_group`` dicts.
    """
    with _ordinary_pages():
        if window is None:
            window = measured_window(records, warmup, cooldown)
        slo_of = _slo_lookup(slos)
        if isinstance(slos, dict):
            slo_dump = {k: v.to_dict() for k, v in slos.items()}
        else:
            slo_dump = {"*": (slos or SLO()).to_dict()}
        kw: dict[str, Any] = {"n_boot": n_boot, "seed": seed, "confidence": confidence}
        gaps = Gaps.of(records)
        cols = _Columns(records, window, slo_of, gaps)
        by_class: dict[str, list[int]] = {}
        by_bucket: dict[str, list[int]] = {}
        for i, r in enumerate(records):
            by_class.setdefault(r.workload_class, []).append(i)
            by_bucket.setdefault(bucket_label(r.input_tokens, bucket_edges), []).append(i)
        bucket_order = [bucket_label(e - 1, bucket_edges) for e in bucket_edges] + [
            bucket_label(bucket_edges[-1], bucket_edges)
        ]

        overall = cols.group(np.arange(len(records)), **kw)

        def group(idx: list[int]) -> dict[str, Any]:
            if len(idx) == len(records):  # one class or bucket holds every record
                return copy.deepcopy(overall)
            return cols.group(np.asarray(idx, dtype=np.int64), **kw)

        by_class_summary = {k: group(v) for k, v in sorted(by_class.items())}
        by_bucket_summary = {k: group(by_bucket[k]) for k in bucket_order if k in by_bucket}
        overall["prefix_reuse_ideal"] = similarity["overall"] if similarity else None
        for k, g in by_class_summary.items():
            g["prefix_reuse_ideal"] = similarity["by_class"].get(k) if similarity else None
        return {
            "window": window.to_dict(),
            "similarity": {k: v for k, v in similarity.items() if k != "by_class"}
            if similarity
            else None,
            "counts": {
                "records": len(records),
                "sent_in_window": int(cols.sent.sum()),
                "ok": int(cols.ok.sum()),
                "failed": int((~cols.ok).sum()),
            },
            "tokens": token_checks(records),
            "slos": slo_dump,
            "overall": overall,
            "by_class": by_class_summary,
            "by_input_bucket": by_bucket_summary,
            "timeslices": timeslices(
                records, window.start, window.end, slice_duration, series, gaps=gaps
            ),
        }


def run_summary(run: Run) -> dict[str, Any]:
    """The whole run's ``summarize`` body: metrics.json's when it holds one, else computed
    from the records once per run (a sweep's metrics.json holds per-stage bodies only)."""
    if "summary" not in run.derived:
        m = run.metrics or {}
        run.derived["summary"] = m if "overall" in m else summarize(run.records)
    return run.derived["summary"]


def run_timeslices(run: Run, series: ServerSeries | None = None) -> dict[str, Any] | None:
    """The whole run's ``timeslices`` (metrics.json's, else computed over the recorded
    window with the recorded ``--slice-duration``); None for a sweep (one per stage)."""
    if run.stages:
        return None
    stored = run_summary(run).get("timeslices")
    if stored:
        return stored
    ok = [r for r in run.records if r.ok]
    if not ok:
        return None
    config = run.manifest.get("config") or {}
    slice_s = float(config.get("slice_duration") or DEFAULT_SLICE_DURATION)
    return timeslices(run.records, *run.window, slice_duration=slice_s, series=series)


def stage_summaries(run: Run) -> dict[str, dict[str, Any]]:
    """label -> ``summarize`` body per sweep stage (empty for a single-load run)."""
    stored = {
        s["label"]: s["metrics"]
        for s in (run.metrics or {}).get("stages", [])
        if s.get("label") is not None and s.get("metrics")
    }
    out = {}
    for stage in run.stages:
        if stage in stored:
            out[stage] = stored[stage]
        else:
            recs = [r for r in run.records if r.stage == stage]
            out[stage] = summarize(recs, n_boot=0)
    return out
