"""Findings: causes the data supports, each with numeric evidence and a confidence.

Each detector looks at one cause and returns a `Finding` or None. A detector fires only
when the cause is both present and large enough to move a percentile, so a clean run
yields no findings. ``exact`` is False when the evidence rests on estimates (another
server's /metrics, or the client side alone).
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from servelab.analyze.diagnosis.attribution import LONG_PROMPT, Attribution, TTFTBreakdown
from servelab.analyze.gaps import run_gaps
from servelab.analyze.server_side.promscrape import ServerEstimates
from servelab.analyze.server_side.serversettings import run_settings
from servelab.analyze.server_side.timeseries import ServerSeries
from servelab.analyze.stats import confidence_label, spearman
from servelab.analyze.summary import run_timeslices, stage_summaries
from servelab.analyze.timeslices import DEFAULT_SLICE_DURATION, timeslices
from servelab.rundir import Run
from servelab.vocab import ClientRecord

# Thresholds, in one place so the docs can quote them.
MIN_REQUESTS = 10
PREFILL_RHO = 0.6  # rank correlation input length -> TTFT
PREFILL_SPREAD = 4.0  # p90 / p10 of input lengths
PREFILL_SHARE = 0.5  # prefill share of TTFT in the longest-input quartile
QUEUE_RHO = 0.5  # rank correlation queue depth at arrival -> TTFT
QUEUE_SHARE = 0.3  # queue share of mean TTFT
BIG_STALL = 5.0  # an ITL spike is "long" at this multiple of the request's median gap
STALL_SHARE = 0.03  # share of all decode time lost to such spikes
KV_HIGH = 0.95
REUSE_MIN_REQUESTS = 10
REUSE_HIT_FRACTION = 0.5
DECODE_SHARE = 0.8
DECODE_LONG_OUTPUT = 128
CLIENT_LAG_LIMIT = 0.001  # the benchmark's own accuracy target (docs/reference-figures.md)
CLIENT_LAG_SHARE = 0.05  # lag that distorts TTFT p50 by this much matters
NETWORK_SHARE = 0.3
NETWORK_MIN = 0.020
OPEN_LOOP_WINDOWS = 12  # the open-loop sending window is cut into at least this many windows


@dataclass(kw_only=True)
class Finding:
    id: str
    title: str
    summary: str
    evidence: dict[str, Any]
    confidence: float
    exact: bool
    levers: list[str] = field(default_factory=list)

    @property
    def confidence_label(self) -> str:
        return confidence_label(self.confidence)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"confidence_label": self.confidence_label}


@dataclass(kw_only=True)
class Context:
    run: Run
    attr: Attribution
    est: ServerEstimates | None
    series: ServerSeries | None = None  # the /metrics time series, where there is one

    @property
    def ok(self) -> list[TTFTBreakdown]:
        return self.attr.ttft

    @property
    def server_exact(self) -> bool:
        return self.attr.source in ("exact", "summary", "reported")

    def config(self, key: str, default: Any = None) -> Any:
        """An engine setting: the resolved config a servelab server reported, else the
        label of that name on another server's ``/metrics`` info gauges (vLLM's
        ``vllm:cache_config_info`` carries ``enable_prefix_caching`` and ``block_size``),
        else another server's setting from its launch command or the stated server config
        (``analyze.server_side.serversettings``; not its engine's defaults, which the server may not run
        with)."""
        if key in self.run.engine_config:
            return self.run.engine_config[key]
        for labels in (self.run.server.get("info_metrics") or {}).values():
            if key in labels:
                return _label_value(labels[key])
        return run_settings(self.run).stated(key, default)


def _label_value(v: str) -> Any:
    """A Prometheus label as the setting it states (labels are always strings)."""
    if v in ("True", "False"):
        return v == "True"
    if v == "None":
        return None
    try:
        return int(v)
    except ValueError:
        return v


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 1)


def _clip(x: float) -> float:
    return float(min(1.0, max(0.0, x)))


def prefill_bound(c: Context) -> Finding | None:
    b = c.ok
    if len(b) < MIN_REQUESTS:
        return None
    inputs = np.array([x.input_tokens for x in b], dtype=float)
    ttft = np.array([x.ttft for x in b])
    p10, p90 = np.percentile(inputs, [10, 90])
    spread = p90 / max(p10, 1.0)
    rho = spearman(inputs.tolist(), ttft.tolist())
    if spread < PREFILL_SPREAD or rho < PREFILL_RHO:
        return None
    slope = float(np.polyfit(inputs, ttft, 1)[0])
    ev: dict[str, Any] = {
        "spearman_input_vs_ttft": round(rho, 3),
        "ttft_ms_per_1k_input_tokens": round(slope * 1e6, 1),
        "input_tokens_p10": int(p10),
        "input_tokens_p90": int(p90),
    }
    share = None
    if c.server_exact:
        p75 = np.percentile(inputs, 75)
        top = [x for x in b if x.input_tokens >= p75]
        share = sum(x.prefill or 0.0 for x in top) / max(sum(x.ttft for x in top), 1e-9)
        ev["prefill_share_of_ttft_longest_quartile"] = round(share, 3)
        if share < PREFILL_SHARE:
            return None
    if c.attr.cost is not None:
        ev["prefill_ms_per_token"] = round(c.attr.cost.prefill_per_token * 1e3, 4)
    levers = ["prefix_caching"] if _has_shared_prefixes(c.run) else []
    if c.config("enable_chunked_prefill") and (share is not None) and _long_prompts_chunked(c):
        levers.append("batch_budget_up")
    conf = _clip((rho - 0.4) / 0.5) * (1.0 if c.server_exact else 0.7)
    return Finding(
        id="prefill_bound",
        title="TTFT grows with input length (prefill-bound)",
        summary=f"TTFT rises {slope * 1e6:.0f} ms per 1k input tokens (Spearman {rho:.2f}); "
        + (
            f"prefill compute is {share:.0%} of TTFT for the longest prompts."
            if share
            else "the server-side split is not available for this target."
        ),
        evidence=ev,
        confidence=conf,
        exact=c.server_exact,
        levers=levers,
    )


def _has_shared_prefixes(run: Run) -> bool:
    groups: dict[str, int] = {}
    for r in run.records:
        if r.prefix_group:
            groups[r.prefix_group] = groups.get(r.prefix_group, 0) + 1
    return any(n > 1 for n in groups.values())


def _long_prompts_chunked(c: Context) -> bool:
    budget = c.config("max_num_batched_tokens")
    return bool(budget) and any(x.input_tokens > budget for x in c.ok)


def queue_bound(c: Context) -> Finding | None:
    b = c.ok
    if len(b) < MIN_REQUESTS:
        return None
    depth = [x.queue_depth for x in b]
    ttft = [x.ttft for x in b]
    rho = spearman(depth, ttft)
    if rho < QUEUE_RHO or max(depth) < 2:
        return None
    ev: dict[str, Any] = {"spearman_depth_vs_ttft": round(rho, 3), "max_queue_depth": max(depth)}
    if c.server_exact:
        q = [x.queue or 0.0 for x in b]
        share = sum(q) / max(sum(ttft), 1e-9)
        ev |= {
            "queue_share_of_ttft": round(share, 3),
            "queue_ms_mean": _ms(statistics.fmean(q)),
            "queue_ms_p90": _ms(float(np.percentile(q, 90))),
        }
        if share < QUEUE_SHARE:
            return None
        reasons = _queue_reason_shares(b)
        ev |= {f"queue_time_waiting_on_{k}": round(v, 3) for k, v in reasons.items()}
        if reasons.get("kv", 0.0) >= 0.5:
            return None  # waiting on KV blocks: reported by kv_pressure
    elif c.est is not None and (q_est := c.est.mean("queue")) is not None:
        ev["queue_ms_mean_estimate"] = _ms(q_est)
        if q_est < QUEUE_SHARE * statistics.fmean(ttft):
            return None
    if c.attr.source != "exact" and (behind := _behind_long_prefills(c)):
        # The client's depth (requests awaiting a first token) also counts requests held by
        # one long unchunked prefill, and a foreign server's reported queue time does not say
        # what a request waited for (vLLM without chunked prefill queues arrivals behind a
        # 1,400-token prefill step); keep the finding only if the depth still predicts TTFT
        # without them, otherwise that wait is prefill interference, not capacity. servelab's
        # own timelines name each wait's reason, so exact runs skip this.
        rest = [x for x in b if x.request_id not in behind]
        ev["requests_waiting_behind_long_prefills"] = len(behind)
        if len(rest) >= MIN_REQUESTS:
            rho_rest = spearman([x.queue_depth for x in rest], [x.ttft for x in rest])
            ev["spearman_depth_vs_ttft_without_them"] = round(rho_rest, 3)
            if rho_rest < QUEUE_RHO:
                return None
        elif 2 * len(behind) >= len(b):
            return None  # most requests waited behind long prefills: too few left to say more
    kind, kind_ev = _burst_or_capacity(c)
    ev |= kind_ev
    levers = []
    if ev.get("queue_time_waiting_on_max_num_seqs", 0.0) >= 0.5:
        levers.append("max_num_seqs_up")
    if len(c.run.classes) > 1:
        levers.append("priorities")
    levers.append("capacity")
    conf = _clip((rho - 0.3) / 0.5) * (1.0 if c.server_exact else 0.7)
    return Finding(
        id="queue_bound",
        title=f"TTFT grows with queue depth at arrival ({kind})",
        summary=(
            f"Requests that arrived behind a longer queue waited longer (Spearman {rho:.2f}, up to "
            f"{max(depth)} waiting)"
        )
        + (f"; queueing is {ev['queue_share_of_ttft']:.0%} of TTFT." if c.server_exact else "."),
        evidence=ev,
        confidence=conf,
        exact=c.server_exact,
        levers=levers,
    )


def _behind_long_prefills(c: Context) -> set[str]:
    """Requests whose wait for a first token overlapped a long prompt's prefill window as
    the client saw it (the long prompt's send to its first token), and the long prompts."""
    recs = [r for r in c.run.records if r.ok and r.chunk_times]
    if not recs:
        return set()
    cut = LONG_PROMPT * max(statistics.median(r.input_tokens for r in recs), 1)
    longs = sorted((r.actual_send, r.chunk_times[0]) for r in recs if r.input_tokens >= cut)
    starts = [s for s, _ in longs]
    # a wait [send, first) overlaps a long window (s, f) when s < first and f > send: the
    # latest end among the windows starting before its first token says whether one does
    reach = list(itertools.accumulate((f for _, f in longs), max))
    out = set()
    for r in recs:
        k = bisect.bisect_left(starts, r.chunk_times[0])
        if r.input_tokens >= cut or (k and reach[k - 1] > r.actual_send):
            out.add(r.request_id)
    return out


def _queue_reason_shares(b: list[TTFTBreakdown]) -> dict[str, float]:
    tot: dict[str, float] = {}
    for x in b:
        if x.queue_reason and x.queue:
            tot[x.queue_reason] = tot.get(x.queue_reason, 0.0) + x.queue
    s = sum(tot.values())
    return {k: v / s for k, v in tot.items()} if s > 0 else {}


def _burst_or_capacity(c: Context) -> tuple[str, dict[str, Any]]:
    """Bursty arrivals (CV of inter-arrival gaps > 1.5) or a queue that grows with time."""
    sends = sorted(r.intended_send for r in c.run.records)
    gaps = np.diff(sends)
    cv = float(gaps.std() / gaps.mean()) if len(gaps) > 1 and gaps.mean() > 0 else 0.0
    b = sorted(c.ok, key=lambda x: x.request_id)
    by_id = {r.request_id: r.intended_send for r in c.run.records}
    trend = spearman([by_id[x.request_id] for x in b], [x.ttft for x in b])
    span = sends[-1] - sends[0] if sends else 0.0
    ev = {"arrival_gap_cv": round(cv, 2), "spearman_arrival_time_vs_ttft": round(trend, 3)}
    if cv > 1.5 or span < 0.05 * max(x.ttft for x in c.ok):
        return "bursty arrivals", ev
    if trend >= 0.5:
        return "capacity-bound: the queue grew through the run", ev
    return "capacity-bound at peaks", ev


def over_saturated(c: Context) -> Finding | None:
    """The run never reached a steady state (``analyze.timeslices``), judged over its
    open-loop sending window (``_open_loop_slices``): per stage for a sweep."""
    m = c.run.manifest
    load = c.run.load
    stage_loads = {s.get("label"): s.get("load") or load for s in m.get("stages") or []}
    per_stage = {
        k: _open_loop_slices(
            c,
            [r for r in c.run.records if r.stage == k],
            v.get("timeslices"),
            stage_loads.get(k, load),
        )
        for k, v in stage_summaries(c.run).items()
    }
    stages = per_stage or {
        "": _open_loop_slices(
            c, c.run.records, run_timeslices(c.run, c.series), load, c.run.window[0]
        )
    }
    over = {
        label: ts
        for label, ts in stages.items()
        if ts and ts["saturation"]["state"] == "over_saturated"
    }
    if not over:
        return None
    label, ts = next(iter(over.items()))
    sat = ts["saturation"]
    ttft, depth = sat["ttft_p50_trend"], sat["queue_depth_trend"]
    ev: dict[str, Any] = {
        "offered_rate": round(ts["offered_rate"], 3),
        "achieved_rate": round(ts["achieved_rate"], 3),
        "ttft_p50_growth_ms_per_minute": round(ttft["slope_per_minute"] * 1e3, 1),
        "queue_depth_growth_per_minute": round(depth["slope_per_minute"], 2),
        "queue_depth_source": ts["depth_source"],
        "windows": ttft["windows"],
        "slice_duration_s": ts["slice_duration_s"],
        "p_ttft_rising": ttft["p_rising"],
        "p_queue_depth_rising": depth["p_rising"],
    }
    if ts.get("open_loop_window_s") is not None:
        ev["open_loop_window_s"] = round(ts["open_loop_window_s"], 1)
    if label:
        ev["stages"] = ", ".join(over)
    where = f" (stage {', '.join(over)})" if label else ""
    return Finding(
        id="over_saturated",
        title="Over-saturated: the queue grew through the run" + where,
        summary=(
            f"{ev['offered_rate']:.3g} req/s were offered and {ev['achieved_rate']:.3g} req/s "
            f"completed; TTFT p50 grew {ev['ttft_p50_growth_ms_per_minute']:.0f} ms per minute and "
            f"the queue {ev['queue_depth_growth_per_minute']:.1f} requests per minute. Percentiles "
            "of this run depend on its length, not only on the server: lower the rate below "
            f"{ev['achieved_rate']:.3g} req/s to measure a steady state."
        ),
        evidence=ev,
        confidence=_clip(1.0 - max(ttft["p_rising"], depth["p_rising"]) * 4),
        exact=True,
        levers=["capacity"],
    )


def _open_loop_slices(
    c: Context,
    records: list[ClientRecord],
    stored: dict[str, Any] | None,
    load: dict[str, Any],
    start: float | None = None,
) -> dict[str, Any] | None:
    """The time windows over the open-loop sending window: from the first send to the last
    first turn's. After it, an open loop of multi-turn sessions only sends the later turns
    of sessions already begun, each as its previous turn is answered: that tail drains the
    queue whatever the server's capacity, and a trend test over the whole run reads the rise
    and fall as no trend. ``stored`` (the whole run's) stands where there is no such tail:
    a closed loop, or no later turn sent after the last first turn.

    The sending window is cut into at least ``OPEN_LOOP_WINDOWS`` windows (shorter than
    ``--slice-duration`` where it must): a minute of sends in 10 s windows gives the trend
    test six points, where one slow first window (the queue forms within seconds) is enough
    to leave a doubling TTFT unproven."""
    firsts = [r.actual_send for r in records if r.turn == 0]
    if load.get("rate") is None or load.get("concurrency") is not None or not firsts:
        return stored
    end = max(firsts)
    if not any(r.turn > 0 and r.actual_send > end for r in records):
        return stored
    begin = min(firsts) if start is None else start
    config = c.run.manifest.get("config") or {}
    slice_s = float(config.get("slice_duration") or DEFAULT_SLICE_DURATION)
    slice_s = min(slice_s, (end - begin) / OPEN_LOOP_WINDOWS) if end > begin else slice_s
    ts = timeslices(records, begin, end, slice_duration=slice_s, series=c.series)
    ts["open_loop_window_s"] = end - begin
    return ts


def itl_prefill_interference(c: Context) -> Finding | None:
    gaps = run_gaps(c.run)
    ok = [r.ok for r in c.run.records]
    gaps_total = sum(t for t, keep in zip(gaps.record_sums, ok) if keep)
    if gaps_total <= 0:
        return None
    big = [s for s in c.attr.stalls if s.cause == "prefill" and s.gap >= BIG_STALL * s.median_gap]
    excess = sum(s.excess for s in big)
    share = excess / gaps_total
    if len(big) < 3 or share < STALL_SHARE:
        return None
    exact = all(s.exact for s in big)
    itls = gaps.values[gaps.mask(np.array(ok, bool))]  # a copy: selected in place below
    ev: dict[str, Any] = {
        "long_prefill_stalls": len(big),
        "share_of_decode_time_lost": round(share, 3),
        "stall_ms_max": _ms(max(s.gap for s in big)),
        "itl_ms_p50": _ms(float(np.median(itls, overwrite_input=True))),
        "itl_ms_p99": _ms(float(np.percentile(itls, 99, overwrite_input=True))),
        "chunked_prefill": c.config("enable_chunked_prefill"),
        "max_num_batched_tokens": c.config("max_num_batched_tokens"),
    }
    if exact:
        ev["co_scheduled_prefill_tokens_mean"] = round(
            statistics.fmean(s.evidence.get("prefill_tokens", 0) for s in big), 1
        )
    chunked = c.config("enable_chunked_prefill")
    levers = ["chunked_prefill"] if chunked is False else ["batch_budget_down"]
    levers.append("disaggregation")
    conf = _clip(0.5 + share * 5) * statistics.fmean(s.confidence for s in big)
    if not exact:
        ev["stall_cause_confidence_mean"] = round(statistics.fmean(s.confidence for s in big), 2)
    return Finding(
        id="itl_prefill_interference",
        title="ITL spikes line up with long prefills"
        + (
            " (chunked prefill would help)"
            if chunked is False
            else " (a smaller chunk budget would help)"
        ),
        summary=(
            f"{len(big)} inter-token gaps of {BIG_STALL:.0f}x the request's median or more ran "
            f"beside another request's prefill; they cost {share:.1%} of all decode time (worst "
            f"{ev['stall_ms_max']} ms vs a {ev['itl_ms_p50']} ms median)."
        ),
        evidence=ev,
        confidence=conf,
        exact=exact,
        levers=levers,
    )


def kv_pressure(c: Context) -> Finding | None:
    ev: dict[str, Any] = {}
    exact = True
    if c.run.timelines:
        preempted = [t for t in c.run.timelines.values() if t.preemptions]
        n_pre = sum(len(t.preemptions) for t in preempted)
        ev["preemptions"] = n_pre
        ev["requests_preempted"] = len(preempted)
        usage = [s.kv_blocks_used / s.kv_blocks_total for s in c.run.steps if s.kv_blocks_total]
        if usage:
            ev["kv_usage_max"] = round(max(usage), 3)
            ev["steps_with_kv_above_90pct"] = round(sum(u >= 0.9 for u in usage) / len(usage), 3)
        shares = _queue_reason_shares(c.ok)
        if shares.get("kv"):
            ev["queue_time_waiting_on_kv"] = round(shares["kv"], 3)
        lost = sum(x.preemption or 0.0 for x in c.ok)
        lost += sum(s.excess for s in c.attr.stalls if s.cause == "preemption")
        ev["seconds_lost_to_preemption"] = round(lost, 3)
    elif c.est is not None:
        exact = False
        if "preemptions" in c.est.counters:
            n_pre = int(c.est.counters["preemptions"])
            ev["preemptions"] = n_pre
        if "kv_usage" in c.est.gauges_max:
            ev["kv_usage_max"] = round(c.est.gauges_max["kv_usage"], 3)
    else:
        return None
    if not ev.get("preemptions") and ev.get("kv_usage_max", 0.0) < KV_HIGH:
        return None
    levers = ["kv_memory", "max_num_seqs_down"]
    if _has_shared_prefixes(c.run):
        levers.append("prefix_caching")
    if len(c.run.classes) > 1:
        levers.append("priorities")
    conf = 0.9 if ev.get("preemptions") else 0.5
    return Finding(
        id="kv_pressure",
        title="KV cache pressure" + (" and preemptions" if ev.get("preemptions") else ""),
        summary=(
            f"{ev.get('preemptions', 0)} preemption(s); KV usage peaked at "
            f"{ev.get('kv_usage_max', float('nan')):.0%}"
        )
        + (
            f"; {ev['seconds_lost_to_preemption']:.2f} s of request time was lost to recompute "
            "and re-queueing."
            if "seconds_lost_to_preemption" in ev
            else "."
        ),
        evidence=ev,
        confidence=conf if exact else conf * 0.7,
        exact=exact,
        levers=levers,
    )


def low_prefix_reuse(c: Context) -> Finding | None:
    groups: dict[str, list] = {}
    for r in sorted(c.run.records, key=lambda r: r.actual_send):
        if r.prefix_group and r.ok:
            groups.setdefault(r.prefix_group, []).append(r)
    reusable = [r for g in groups.values() for r in g[1:]]
    if len(reusable) < REUSE_MIN_REQUESTS:
        return None
    caching = c.config("enable_prefix_caching")
    ev: dict[str, Any] = {
        "prefix_groups": len(groups),
        "requests_that_could_reuse": len(reusable),
        "prefix_caching": caching,
    }
    if c.run.timelines:
        hits = 0
        cached = 0
        for r in reusable:
            tl = c.run.timeline_for(r)
            if tl is not None and tl.cached_tokens > 0:
                hits += 1
                cached += tl.cached_tokens
        frac = hits / len(reusable)
        ev["fraction_with_cache_hits"] = round(frac, 3)
        ev["cached_tokens_share"] = round(cached / max(sum(r.input_tokens for r in reusable), 1), 3)
        exact = True
    elif caching is False:
        # The server says so itself; its cache counters then stay at zero.
        frac, exact = 0.0, False
    elif c.est is not None and c.est.counters.get("prefix_cache_queries"):
        hit_rate = (
            c.est.counters.get("prefix_cache_hits", 0.0) / c.est.counters["prefix_cache_queries"]
        )
        ev["prefix_cache_hit_rate_estimate"] = round(hit_rate, 3)
        # The counters are tokens, not requests: judge them against the share of prompt
        # tokens an ideal cache could have served (analyze.similarity), where it is known.
        ideal = ((c.run.metrics or {}).get("similarity") or {}).get("overall")
        if ideal:
            ev["prefix_reuse_ideal"] = round(ideal, 3)
            frac = hit_rate / ideal
            ev["share_of_ideal"] = round(frac, 3)
        else:
            frac = hit_rate
        exact = False
    else:
        return None
    if frac >= REUSE_HIT_FRACTION:
        return None
    why = (
        "prefix caching is off"
        if caching is False
        else "cached blocks were evicted or the shared part is not an identical prefix"
    )
    return Finding(
        id="low_prefix_reuse",
        title="Low prefix reuse despite shared prompts",
        summary=(
            f"{len(reusable)} requests share a prompt prefix with an earlier one, but only "
            f"{frac:.0%} {'of the reusable tokens ' if 'share_of_ideal' in ev else ''}reused "
            f"cached KV ({why})."
        ),
        evidence=ev,
        confidence=0.9 if exact or caching is False else 0.6,
        exact=exact,
        levers=["prefix_caching"],
    )


def decode_bound(c: Context) -> Finding | None:
    recs = [r for r in c.run.records if r.ok and r.e2e and r.ttft is not None]
    if len(recs) < MIN_REQUESTS:
        return None
    e2e = sum(r.e2e or 0.0 for r in recs)
    dec = sum((r.e2e or 0.0) - (r.ttft or 0.0) for r in recs)
    share = dec / e2e if e2e > 0 else 0.0
    out_med = statistics.median(r.output_tokens for r in recs)
    if share < DECODE_SHARE or out_med < DECODE_LONG_OUTPUT:
        return None
    tpots = [r.tpot for r in recs if r.tpot is not None]
    ev: dict[str, Any] = {
        "decode_share_of_e2e": round(share, 3),
        "output_tokens_p50": out_med,
        "tpot_ms_p50": _ms(statistics.median(tpots)) if tpots else None,
    }
    batches = [s.decode_seqs for s in c.run.steps if s.decode_seqs]
    if batches:
        ev["decode_batch_mean"] = round(statistics.fmean(batches), 1)
    small_batch = ev.get("decode_batch_mean", 1.0) <= 4
    levers = (
        ["speculative_decoding"] if small_batch else ["max_num_seqs_down", "speculative_decoding"]
    )
    return Finding(
        id="decode_bound",
        title="Decode-bound: long outputs dominate latency",
        summary=(
            f"Decode is {share:.0%} of end-to-end time with a median of {out_med:.0f} output "
            f"tokens; TPOT p50 {ev['tpot_ms_p50']} ms."
        ),
        evidence=ev,
        confidence=_clip((share - 0.6) / 0.3),
        exact=True,
        levers=levers,
    )


def client_bottleneck(c: Context) -> Finding | None:
    recs = [r for r in c.run.records if r.chunk_times]
    if not recs:
        return None
    lag = np.array([r.send_lag for r in recs])
    p99 = float(np.percentile(lag, 99))
    ttft_p50 = float(np.median([r.ttft for r in recs]))
    gaps_total = sum(t for t, r in zip(run_gaps(c.run).record_sums, c.run.records) if r.chunk_times)
    client_stalls = [s for s in c.attr.stalls if s.cause == "client"]
    stall_share = sum(s.excess for s in client_stalls) / gaps_total if gaps_total > 0 else 0.0
    lag_matters = p99 > CLIENT_LAG_LIMIT and p99 >= CLIENT_LAG_SHARE * ttft_p50
    stalls_matter = len(client_stalls) >= 3 and stall_share >= STALL_SHARE
    if c.run.valid and not lag_matters and not stalls_matter:
        return None
    ev: dict[str, Any] = {
        "send_lag_ms_p50": _ms(float(np.median(lag))),
        "send_lag_ms_p99": _ms(p99),
        "send_lag_ms_max": _ms(float(lag.max())),
        "client_side_itl_stalls": len(client_stalls),
        "share_of_decode_time_lost_in_client": round(stall_share, 3),
        "run_valid": c.run.valid,
    }
    if c.run.invalid_reason:
        ev["invalid_reason"] = c.run.invalid_reason
    parts = []
    if lag_matters:
        parts.append(
            f"requests left the client up to {p99 * 1e3:.0f} ms (p99) after their intended time"
        )
    if stalls_matter:
        parts.append(
            f"{len(client_stalls)} token gaps were stretched after the server had sent the token"
        )
    if not c.run.valid:
        parts.append(f"the benchmark marked the run invalid: {c.run.invalid_reason}")
    if lag_matters or stalls_matter:
        title = "The client was the bottleneck: this run is not a valid measurement of the server"
        tail = ". Latencies from the intended send time include the client's delay."
        conf = 0.95 if lag_matters else 0.7
    else:
        # Only the benchmark's own (strict) check failed: say how much it can matter here.
        title = "The benchmark marked this run invalid (client-side timing)"
        tail = (
            f". The client's send lag (p99 {p99 * 1e3:.1f} ms) and stretched token gaps are "
            f"small next to a TTFT p50 of {ttft_p50 * 1e3:.0f} ms, so the server's figures "
            "are likely usable; rerun on a quieter machine to be sure."
        )
        conf = 0.5
    return Finding(
        id="client_bottleneck",
        title=title,
        summary="; ".join(parts) + tail,
        evidence=ev,
        confidence=conf,
        exact=True,
        levers=["client"],
    )


def network_overhead(c: Context) -> Finding | None:
    net = [x.network_http for x in c.ok if x.network_http is not None]
    if len(net) < MIN_REQUESTS:
        return None
    med = statistics.median(net)
    ttft_med = statistics.median(x.ttft for x in c.ok)
    if med < NETWORK_MIN or med < NETWORK_SHARE * ttft_med:
        return None
    summary = (
        f"Outside the engine, each request spent a median {med * 1e3:.0f} ms "
        f"({med / ttft_med:.0%} of TTFT p50) in HTTP handling, tokenisation and streaming."
    )
    conf = 0.8 if c.server_exact else 0.5
    client_side = [
        x.connection + x.sending for x in c.ok if x.connection is not None and x.sending is not None
    ]
    if client_side:
        # Connection set-up and sending are split out of this part: what is left starts once
        # the request's last byte was written, so it is the server's until its clock starts.
        summary += (
            f" The client's own connection wait and sending took a median "
            f"{statistics.median(client_side) * 1e3:.1f} ms beside it, so it lies between the "
            "request written and the server's clock starting (its accept and read queue, HTTP "
            "parsing, tokenisation) and in delivering the first token."
        )
    if not c.run.valid:
        # This part is the client's TTFT less the server's own figures, so a client that fell
        # behind lands in it (docs/design/analyze.md: a client starved of CPU inflates it).
        summary += (
            " The benchmark marked the run invalid on client-side timing, so part of it may be"
            " the client's own delay."
        )
        conf = 0.3
    return Finding(
        id="network_overhead",
        title="HTTP, tokenisation and delivery take a large share of TTFT",
        summary=summary,
        evidence={
            "network_http_ms_p50": _ms(med),
            "ttft_ms_p50": _ms(ttft_med),
            "run_valid": c.run.valid,
        },
        confidence=conf,
        exact=c.attr.source == "exact",
        levers=["api_process"],
    )


DETECTORS: tuple[Callable[[Context], Finding | None], ...] = (
    client_bottleneck,
    over_saturated,
    queue_bound,
    prefill_bound,
    itl_prefill_interference,
    kv_pressure,
    low_prefix_reuse,
    decode_bound,
    network_overhead,
)


def find_all(c: Context) -> list[Finding]:
    """Every finding the data supports, most confident first."""
    out = [f for det in DETECTORS if (f := det(c)) is not None]
    return sorted(out, key=lambda f: -f.confidence)
