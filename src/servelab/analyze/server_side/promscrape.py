"""Server-side estimates for targets other than servelab, from Prometheus /metrics scrapes.

The benchmark scrapes /metrics before, during and after the measured window
(``metrics_scrape.jsonl``: {"t": monotonic, "text": exposition}). The difference of the
last and first scrape of a histogram gives the distribution of what the server
observed during the run; means are exact for the requests counted, quantiles are
estimates interpolated inside buckets (Prometheus' histogram_quantile), and nothing is
per request. vLLM's metric names are used, as servelab's own /metrics does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# Each key's histogram, by the names it has had: vLLM 0.32 calls TPOT
# ``vllm:request_time_per_output_token_seconds``; older builds and servelab's own server
# ``vllm:time_per_output_token_seconds``. The first name a scrape carries is read.
HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "ttft": ("vllm:time_to_first_token_seconds",),
    "queue": ("vllm:request_queue_time_seconds",),
    "prefill": ("vllm:request_prefill_time_seconds",),
    "decode": ("vllm:request_decode_time_seconds",),
    "itl": ("vllm:inter_token_latency_seconds",),
    "tpot": (
        "vllm:request_time_per_output_token_seconds",
        "vllm:time_per_output_token_seconds",
    ),
    "e2e": ("vllm:e2e_request_latency_seconds",),
}
COUNTERS = {
    "preemptions": "vllm:num_preemptions_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
}
GAUGES = {
    "kv_usage": "vllm:kv_cache_usage_perc",
    "waiting": "vllm:num_requests_waiting",
    "running": "vllm:num_requests_running",
}


@dataclass
class HistDelta:
    """One histogram's increase over the run: cumulative bucket counts, sum and count."""

    buckets: list[tuple[float, float]]  # (upper bound, cumulative count), sorted
    total: float
    count: float

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """histogram_quantile: linear inside the bucket holding rank q * count.

        When every observation fell in that one bucket, the mean is the only location the
        histogram gives inside it, and it is returned instead: interpolation would put all of
        them mid-bucket (vLLM's queue-time buckets start at 0.3 s, so a 30 us queue would
        read as 150 ms).
        """
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        prev_le, prev_c = 0.0, 0.0
        for le, c in self.buckets:
            if c >= rank:
                if prev_c == 0.0 and c >= self.count and self.mean is not None:
                    return min(max(self.mean, prev_le), le)
                if le == float("inf"):
                    return prev_le  # the top bucket has no upper edge: report its floor
                if c == prev_c:
                    return le
                return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
            prev_le, prev_c = le, c
        return prev_le


@dataclass
class ServerEstimates:
    histograms: dict[str, HistDelta] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    gauges_max: dict[str, float] = field(default_factory=dict)
    n_scrapes: int = 0

    def mean(self, key: str) -> float | None:
        h = self.histograms.get(key)
        return h.mean if h else None

    def to_dict(self) -> dict[str, Any]:
        hist = {
            k: {"mean": h.mean, "p50": h.quantile(0.5), "p90": h.quantile(0.9), "count": h.count}
            for k, h in self.histograms.items()
        }
        return {
            "histograms": hist,
            "counters": self.counters,
            "gauges_max": self.gauges_max,
            "n_scrapes": self.n_scrapes,
        }


def _families(text: str) -> Iterable[Any]:
    """prometheus_client's metric families of an exposition. Imported here, not with the
    module: every summary imports this module, and only runs with scrapes parse any."""
    from prometheus_client.parser import text_string_to_metric_families

    return text_string_to_metric_families(text)


def samples(text: str) -> dict[tuple[str, str | None], float]:
    """(sample name, le) -> value, summed over every other label (model, engine...)."""
    out: dict[tuple[str, str | None], float] = {}
    for fam in _families(text):
        for s in fam.samples:
            key = (s.name, s.labels.get("le"))
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


def info_metrics(text: str) -> dict[str, dict[str, str]]:
    """The labels of each ``*_info`` gauge (e.g. vLLM's ``vllm:cache_config_info``): how
    a server describes its configuration on /metrics. Labels that differ between samples
    of one family (one per engine or model) are kept from the first."""
    out: dict[str, dict[str, str]] = {}
    for fam in _families(text):
        if not fam.name.endswith("_info") or fam.name.startswith(("python_", "process_")):
            continue
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k != "le"}
            if labels:
                out.setdefault(fam.name, labels)
    return out


def _hist(before: dict, after: dict, name: str) -> HistDelta | None:
    count = after.get((f"{name}_count", None))
    if count is None:
        return None
    buckets = []
    for (sname, le), v in after.items():
        if sname == f"{name}_bucket" and le is not None:
            buckets.append((float(le), v - before.get((sname, le), 0.0)))
    buckets.sort()
    return HistDelta(
        buckets,
        after.get((f"{name}_sum", None), 0.0) - before.get((f"{name}_sum", None), 0.0),
        count - before.get((f"{name}_count", None), 0.0),
    )


def parse_scrapes(scrapes: list[dict[str, Any]]) -> list[tuple[float, dict]]:
    """(time, samples) per scrape, in time order; a scrape that is not Prometheus text is
    skipped (the scraper checked the first one; a server may still send garbage later)."""
    out = []
    for s in sorted(scrapes, key=lambda s: s.get("t", 0.0)):
        try:
            out.append((float(s.get("t", 0.0)), samples(s.get("text", ""))))
        except (ValueError, TypeError, IndexError):
            continue
    return out


def estimate(
    scrapes: list[dict[str, Any]], parsed_scrapes: list[tuple[float, dict]] | None = None
) -> ServerEstimates | None:
    """Deltas between the first and last scrape; None with fewer than two scrapes."""
    timed = parsed_scrapes if parsed_scrapes is not None else parse_scrapes(scrapes)
    if len(timed) < 2:
        return None
    parsed = [p for _, p in timed]
    before, after = parsed[0], parsed[-1]
    est = ServerEstimates(n_scrapes=len(parsed))
    for key, names in HISTOGRAMS.items():
        for name in names:
            h = _hist(before, after, name)
            if h is not None:
                if h.count > 0:
                    est.histograms[key] = h
                break
    for key, name in COUNTERS.items():
        if (name, None) in after:
            est.counters[key] = after[(name, None)] - before.get((name, None), 0.0)
    for key, name in GAUGES.items():
        vals = [p[(name, None)] for p in parsed if (name, None) in p]
        if vals:
            est.gauges_max[key] = max(vals)
    return est
