"""The server's state over the run, from the ``/metrics`` time series (vLLM names).

The benchmark scrapes ``/metrics`` every 0.5 s by default. Gauges (waiting, running, KV
usage) are read as step functions: a value holds from its scrape to the next. Counters
(preemptions, prefix-cache queries and hits) are cumulative since the server started, so
only their increases between scrapes mean anything: a preemption window is an interval
between two scrapes in which the counter rose, and the run's prefix-cache hit rate is
the hits' delta over the queries' delta. Nothing here is per request; the resolution is
the scrape interval, which the figures carry.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servelab.analyze.server_side.promscrape import COUNTERS, GAUGES

KV_PRESSURE = 0.9  # KV usage from which the cache is "nearly full"


@dataclass
class ServerSeries:
    t: list[float]
    gauges: dict[str, list[float | None]] = field(default_factory=dict)
    counters: dict[str, list[float | None]] = field(default_factory=dict)

    @property
    def interval(self) -> float:
        return float(np.median(np.diff(self.t))) if len(self.t) > 1 else 0.0

    def values(self, key: str) -> list[tuple[float, float]]:
        return [(t, v) for t, v in zip(self.t, self.gauges.get(key, [])) if v is not None]

    def at(self, key: str, t: float) -> float | None:
        """The gauge's value at ``t``: the last scrape at or before it."""
        i = bisect.bisect_right(self.t, t) - 1
        vals = self.gauges.get(key)
        return vals[i] if vals and i >= 0 else None

    def peak(self, key: str, a: float, b: float) -> float | None:
        """The gauge's highest value in force during [a, b]."""
        lo = max(0, bisect.bisect_right(self.t, a) - 1)
        hi = bisect.bisect_right(self.t, b)
        vals = [v for v in self.gauges.get(key, [])[lo:hi] if v is not None]
        return max(vals) if vals else None

    def increases(self, key: str) -> list[tuple[float, float, float]]:
        """(from, to, by how much) for each scrape interval in which a counter rose."""
        vals = self.counters.get(key, [])
        out, prev = [], None
        for i, v in enumerate(vals):
            if v is None:
                continue
            if prev is not None and v > vals[prev]:  # type: ignore[operator]
                out.append((self.t[prev], self.t[i], v - vals[prev]))  # type: ignore[operator]
            prev = i
        return out

    def rose_during(self, key: str, a: float, b: float) -> float:
        """How much a counter rose in the scrape intervals overlapping [a, b]."""
        return sum(d for lo, hi, d in self.increases(key) if lo < b and hi > a)

    def delta(self, key: str) -> float | None:
        vals = [v for v in self.counters.get(key, []) if v is not None]
        return vals[-1] - vals[0] if len(vals) > 1 else None

    def prefix_hit_rate(self) -> float | None:
        q, h = self.delta("prefix_cache_queries"), self.delta("prefix_cache_hits")
        return h / q if q and h is not None and q > 0 else None

    def trend_per_minute(self, key: str) -> float | None:
        """Least-squares slope of a gauge against time, per minute."""
        pts = self.values(key)
        if len(pts) < 3 or pts[-1][0] - pts[0][0] <= 0:
            return None
        ts, vs = zip(*pts)
        return float(np.polyfit(ts, vs, 1)[0] * 60.0)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "scrapes": len(self.t),
            "interval_s": round(self.interval, 3),
            "span_s": round(self.t[-1] - self.t[0], 3) if self.t else 0.0,
        }
        for key in GAUGES:
            pts = [v for _, v in self.values(key)]
            if pts:
                out[key] = {"max": max(pts), "mean": round(float(np.mean(pts)), 4)}
        if (tr := self.trend_per_minute("waiting")) is not None:
            out["waiting_trend_per_minute"] = round(tr, 3)
        pre = self.increases("preemptions")
        if self.counters.get("preemptions"):
            out["preemption_windows"] = [[a, b, d] for a, b, d in pre]
        kv = [(t, v) for t, v in self.values("kv_usage") if v >= KV_PRESSURE]
        out["scrapes_with_kv_above_90pct"] = len(kv)
        if (hr := self.prefix_hit_rate()) is not None:
            out["prefix_cache_hit_rate"] = round(hr, 4)
        return out


def server_series(parsed: list[tuple[float, dict]]) -> ServerSeries | None:
    """The series from parsed scrapes (``promscrape.parse_scrapes``); None with fewer than
    two or when none carries a gauge or counter read here."""
    if len(parsed) < 2:
        return None
    s = ServerSeries([t for t, _ in parsed])
    for key, name in GAUGES.items():
        vals = [p.get((name, None)) for _, p in parsed]
        if any(v is not None for v in vals):
            s.gauges[key] = vals
    for key, name in COUNTERS.items():
        vals = [p.get((name, None)) for _, p in parsed]
        if any(v is not None for v in vals):
            s.counters[key] = vals
    return s if s.gauges or s.counters else None
