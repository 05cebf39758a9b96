"""Steady state or over-saturated: percentiles per time window and a trend test.

A percentile over a run whose queue grows without bound measures how long the run was,
not the server: every request waits behind all the earlier surplus. So each run is cut
into windows of ``slice_duration`` seconds over the part of the measured window in which
requests were sent (the drain after the last send would show a falling queue that says
nothing about the load). Per window: requests offered (intended sends) and achieved
(successful completions) per second, TTFT/ITL/E2E percentiles of the requests sent in
it, and the mean queue depth. The depth is the server's own count of requests it holds
(``vllm:num_requests_waiting + vllm:num_requests_running`` from the ``/metrics`` time
series) where the series has it, else the client's in-flight count (sent, not finished),
both time-weighted over the window.

The verdict (``saturation``) is a trend test on the per-window series, so that the
correlation between consecutive requests (one burst delays many) is not mistaken for
evidence. A series is *rising* when both hold:

- Mann-Kendall: Kendall's S of the values against window order is significant, one-sided
  p < ``TREND_ALPHA`` (exact null distribution without ties up to ``EXACT_MAX_N``
  windows, the normal approximation with continuity correction above);
- size: the Theil-Sen slope times the span from the first to the last window's middle is
  at least ``GROWTH_MIN`` times the early level (median of the first third of windows),
  and for the depth at least ``DEPTH_GROWTH_MIN`` requests. A queue that fluctuates
  around a level does not double in its run; one that grows without bound does.

``over_saturated``: depth and TTFT p50 both rise, and the achieved rate (successful
completions per second over the sending span) is at least ``RATE_SHORTFALL`` below the
offered one: the surplus is what queued. ``undetermined``: fewer than
``MIN_SLICES`` windows or ``MIN_REQUESTS`` successful requests (the test cannot tell).
``steady`` otherwise. With 4 windows, only a strictly rising series reaches p < 0.05
(1/24), so at the default 10 s windows a run needs 40 s of sends to be judged.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np

from servelab.analyze.gaps import Gaps
from servelab.analyze.server_side.timeseries import ServerSeries
from servelab.vocab import ClientRecord

DEFAULT_SLICE_DURATION = 10.0  # seconds (`servelab bench --slice-duration`)
MIN_SLICES = 4
MIN_REQUESTS = 20
TREND_ALPHA = 0.05
EXACT_MAX_N = 30
GROWTH_MIN = 1.0  # growth over the run >= this x the early level ("at least doubled")
DEPTH_GROWTH_MIN = 2.0  # requests
RATE_SHORTFALL = 0.1  # achieved below offered by this share: the surplus queued
PARTIAL_MIN = 0.5  # a last, partial window counts when it is at least this full


@dataclass(frozen=True, kw_only=True)
class Trend:
    """Mann-Kendall S and one-sided p, Theil-Sen slope (per second), growth, early level."""

    n: int
    s: int
    p: float
    slope: float
    growth: float
    early: float
    rising: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "windows": self.n,
            "kendall_s": self.s,
            "p_rising": round(self.p, 5),
            "slope_per_minute": round(self.slope * 60.0, 6),
            "growth": round(self.growth, 6),
            "early_level": round(self.early, 6),
            "rising": self.rising,
        }


def _mahonian(n: int) -> np.ndarray:
    """Permutations of n items by number of inversions (Kendall's null distribution)."""
    counts = np.ones(1)
    for k in range(2, n + 1):
        counts = np.convolve(counts, np.ones(k))
    return counts


def kendall_p_rising(values: Sequence[float] | np.ndarray) -> tuple[int, float]:
    """Kendall's S of ``values`` against their order and the one-sided p of S this large."""
    y = np.asarray(values, dtype=float)
    n = y.size
    if n < 2:
        return 0, 1.0
    diff = y[None, :] - y[:, None]
    s = int(np.sign(diff[np.triu_indices(n, 1)]).sum())
    pairs = n * (n - 1) // 2
    if n <= EXACT_MAX_N:
        # S = pairs - 2 * inversions; P(S >= s) = P(inversions <= (pairs - s) / 2)
        dist = _mahonian(n)
        k = math.floor((pairs - s) / 2 + 1e-9)
        return s, float(dist[: k + 1].sum() / dist.sum())
    var = n * (n - 1) * (2 * n + 5) / 18.0
    z = (s - 1) / math.sqrt(var) if s > 0 else 0.0
    return s, 1.0 - NormalDist().cdf(z)


def trend(t: Sequence[float], values: Sequence[float], min_growth: float = 0.0) -> Trend | None:
    """The trend of ``values`` (one per window, at times ``t``); None with < 2 points."""
    pts = [(a, b) for a, b in zip(t, values) if b is not None and math.isfinite(b)]
    if len(pts) < 2:
        return None
    ts = np.array([a for a, _ in pts])
    ys = np.array([b for _, b in pts])
    s, p = kendall_p_rising(ys)
    i, j = np.triu_indices(len(ys), 1)
    slope = float(np.median((ys[j] - ys[i]) / (ts[j] - ts[i])))
    growth = slope * float(ts[-1] - ts[0])
    early = float(np.median(ys[: max(1, len(ys) // 3)]))
    rising = p < TREND_ALPHA and growth >= max(min_growth, GROWTH_MIN * early) and growth > 0
    return Trend(n=len(ys), s=s, p=p, slope=slope, growth=growth, early=early, rising=rising)


def _end(r: ClientRecord) -> float:
    if r.done is not None:
        return r.done
    return r.chunk_times[-1] if r.chunk_times else r.actual_send


def _pcts(vals: np.ndarray) -> dict[str, float | None]:
    """``describe``'s p50, p90 and p99 of the finite values (the same selection, without the
    rest of ``describe``: a long run has thousands of windows)."""
    v = vals[np.isfinite(vals)]
    if not v.size:
        return {"p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(v, (50, 90, 99)).tolist()
    return {"p50": p50, "p90": p90, "p99": p99}


def _server_depth(series: ServerSeries | None) -> list[tuple[float, float]] | None:
    """(scrape time, waiting + running) where the series has both gauges."""
    if series is None or "waiting" not in series.gauges or "running" not in series.gauges:
        return None
    out = [
        (t, w + r)
        for t, w, r in zip(series.t, series.gauges["waiting"], series.gauges["running"])
        if w is not None and r is not None
    ]
    return out or None


def _step_means(pts: list[tuple[float, float]], edges: list[float]) -> list[float | None]:
    """Per window [edges[k], edges[k + 1]], the time-weighted mean of a step function
    (each value holds until the next point).

    With the points in time order, only those from the last one at or before a window's
    start to the last one before its end hold in it: a bisection finds them, and each
    window sums the same terms in the same order as a scan of every point would."""
    ts = [t for t, _ in pts]
    ordered = all(x <= y for x, y in itertools.pairwise(ts))
    out: list[float | None] = []
    for a, b in itertools.pairwise(edges):
        lo, hi = 0, len(pts)
        if ordered:
            lo, hi = max(0, bisect.bisect_right(ts, a) - 1), bisect.bisect_left(ts, b)
        total = 0.0
        for k in range(lo, hi):
            nxt = ts[k + 1] if k + 1 < len(ts) else math.inf
            lo_t, hi_t = max(a, ts[k]), min(b, nxt)
            if hi_t > lo_t:
                total += pts[k][1] * (hi_t - lo_t)
        covered = b - max(a, ts[0])
        out.append(total / covered if covered > 0 else None)
    return out


def _in_flight_seconds(sends: np.ndarray, ends: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Per window [edges[k], edges[k + 1]]: the request-seconds in flight in it, summed
    over the requests whose [send, end] overlaps it, in record order.

    Each request is paired only with the windows it overlaps (a run of consecutive ones),
    so the work is the number of such pairs, not requests x windows."""
    n_win = len(edges) - 1
    first = np.searchsorted(edges[1:], sends, "right")  # first window ending after the send
    last = np.searchsorted(edges[:-1], ends, "left") - 1  # last window starting before the end
    span = np.maximum(last - first + 1, 0)
    rec = np.repeat(np.arange(len(sends)), span)
    win = np.repeat(first, span) + (np.arange(rec.size) - np.repeat(np.cumsum(span) - span, span))
    a, b = edges[win], edges[win + 1]
    overlap = np.clip(np.minimum(ends[rec], b) - np.maximum(sends[rec], a), 0.0, None)
    order = np.argsort(win, kind="stable")  # by window, records in order within each
    bounds = np.searchsorted(win[order], np.arange(n_win + 1))
    overlap = overlap[order]
    return np.array([overlap[lo:hi].sum() for lo, hi in itertools.pairwise(bounds)])


def timeslices(
    records: Sequence[ClientRecord],
    start: float,
    end: float,
    slice_duration: float = DEFAULT_SLICE_DURATION,
    series: ServerSeries | None = None,
    gaps: Gaps | None = None,
) -> dict[str, Any]:
    """Per-window figures over [start, end] and the saturation verdict (module doc).

    Returns ``{"slice_duration_s", "depth_source", "offered_rate", "achieved_rate",
    "slices": [...], "saturation": {...}}``. Rates are over the sending span; each slice
    has ``start``/``end`` (seconds from ``start``), ``sent``, ``ok``, ``completed``,
    ``offered_rate``, ``achieved_rate``, ``queue_depth`` and ``ttft``/``itl``/``e2e``
    p50/p90/p99 of the requests sent in it. ``gaps`` is ``Gaps.of(records)`` where the
    caller has it.

    The records are sorted and binned once; each window's figures then come from its own
    requests, so the cost grows with the requests and windows, not their product.
    """
    if slice_duration <= 0:
        raise ValueError(f"slice duration must be > 0 s, not {slice_duration:g}")
    n = len(records)
    sends = np.fromiter((r.actual_send for r in records), np.float64, n)
    inside = (sends >= start) & (sends <= end)
    sends_end = float(sends[inside].max()) if inside.any() else start
    span = sends_end - start
    n_full = int(span // slice_duration)
    edge_list = [start + k * slice_duration for k in range(n_full + 1)]
    if span - n_full * slice_duration >= PARTIAL_MIN * slice_duration or n_full == 0:
        edge_list.append(sends_end if n_full else max(sends_end, start + 1e-9))
    edges = np.array(edge_list)
    n_win = len(edges) - 1
    server = _server_depth(series)
    depth_source = "server" if server else "client"
    ok = np.fromiter((r.ok for r in records), bool, n)
    intended = np.sort(np.fromiter((r.intended_send for r in records), np.float64, n))
    done = np.sort(
        np.fromiter((r.done for r in records if r.ok and r.done is not None), np.float64)
    )
    # the window each request was sent in: [a, b), the last one closed at its end
    win = np.searchsorted(edges, sends, "right") - 1
    win[(win == n_win) & (sends == edges[-1])] = n_win - 1
    win[~inside | (win >= n_win)] = -1
    sent_n = np.bincount(win[win >= 0], minlength=n_win)
    ok_win = np.where(ok, win, -1)
    ok_n = np.bincount(ok_win[ok_win >= 0], minlength=n_win)
    offered_n = np.searchsorted(intended, edges[1:], "left") - np.searchsorted(
        intended, edges[:-1], "left"
    )
    completed_n = np.searchsorted(done, edges[1:], "left") - np.searchsorted(
        done, edges[:-1], "left"
    )
    server_depth = _step_means(server, edge_list) if server else None
    if server or not n:
        flight = None
    else:
        ends = np.fromiter((_end(r) for r in records), np.float64, n)
        flight = _in_flight_seconds(sends, ends, edges)
    ttft = np.fromiter((_nan(r.ttft) for r in records), np.float64, n)
    e2e = np.fromiter((_nan(r.e2e) for r in records), np.float64, n)
    gaps = gaps if gaps is not None else Gaps.of(records)
    gap_win = np.repeat(ok_win, gaps.counts)
    by_req = _split(ok_win, n_win)
    by_gap = _split(gap_win, n_win)
    slices: list[dict[str, Any]] = []
    for k in range(n_win):
        a, b = edge_list[k], edge_list[k + 1]
        if server_depth is not None:
            depth = server_depth[k]
        else:
            depth = float(flight[k] / (b - a)) if flight is not None else None
        dur = b - a
        mine = by_req[k]
        slices.append(
            {
                "start": round(a - start, 6),
                "end": round(b - start, 6),
                "sent": int(sent_n[k]),
                "ok": int(ok_n[k]),
                "completed": int(completed_n[k]),
                "offered_rate": int(offered_n[k]) / dur,
                "achieved_rate": int(completed_n[k]) / dur,
                "queue_depth": depth,
                "ttft": _pcts(ttft[mine]),
                "itl": _pcts(gaps.values[by_gap[k]]),
                "e2e": _pcts(e2e[mine]),
            }
        )
    offered_all = int(np.searchsorted(intended, sends_end, "right")) - int(
        np.searchsorted(intended, start, "left")
    )
    done_all = int(np.searchsorted(done, sends_end, "right")) - int(
        np.searchsorted(done, start, "left")
    )
    offered = offered_all / span if span > 0 else None
    achieved = done_all / span if span > 0 else None
    return {
        "slice_duration_s": slice_duration,
        "depth_source": "server /metrics: waiting + running"
        if depth_source == "server"
        else "client: requests in flight",
        "offered_rate": offered,
        "achieved_rate": achieved,
        "slices": slices,
        "saturation": saturation(slices, slice_duration, offered, achieved),
    }


def _nan(x: float | None) -> float:
    return math.nan if x is None else x


def _split(labels: np.ndarray, n: int) -> list[np.ndarray]:
    """For each label 0..n-1, the positions holding it, ascending (-1 is no label)."""
    order = np.argsort(labels, kind="stable")
    bounds = np.searchsorted(labels[order], np.arange(n + 1) - 0.5)
    return [order[lo:hi] for lo, hi in itertools.pairwise(bounds)]


def saturation(
    slices: list[dict[str, Any]],
    slice_duration: float,
    offered: float | None,
    achieved: float | None,
) -> dict[str, Any]:
    """``{"state": steady | over_saturated | undetermined, "reason", trends...}``."""
    full = [s for s in slices if s["ok"] > 0]
    n_ok = sum(s["ok"] for s in full)
    if len(full) < MIN_SLICES or n_ok < MIN_REQUESTS:
        return {
            "state": "undetermined",
            "reason": f"{len(full)} window(s) of {slice_duration:g} s with sends and {n_ok} "
            f"successful request(s): the trend test needs >= {MIN_SLICES} windows and "
            f">= {MIN_REQUESTS} requests (a longer run, or a smaller --slice-duration)",
            "length_dependent": None,
        }
    mid = [(s["start"] + s["end"]) / 2 for s in full]
    depth = trend(mid, [s["queue_depth"] for s in full], DEPTH_GROWTH_MIN)
    ttft = trend(mid, [s["ttft"]["p50"] for s in full])
    short = (
        offered is not None and achieved is not None and achieved < (1 - RATE_SHORTFALL) * offered
    )
    checks = {
        "queue depth rose": bool(depth and depth.rising),
        "TTFT p50 rose": bool(ttft and ttft.rising),
        f"achieved rate >= {RATE_SHORTFALL:.0%} below offered": short,
    }
    over = all(checks.values())
    held = [k for k, v in checks.items() if v]
    return {
        "state": "over_saturated" if over else "steady",
        "reason": " and ".join(held)
        if over
        else "not all of: " + "; ".join(checks) + (f" (held: {', '.join(held)})" if held else ""),
        "checks": checks,
        "length_dependent": over,
        "queue_depth_trend": depth.to_dict() if depth else None,
        "ttft_p50_trend": ttft.to_dict() if ttft else None,
    }
