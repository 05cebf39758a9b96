"""Prometheus metrics of the server: vLLM's names and meanings, plus ``servelab:`` ones.

vLLM compatibility (checked against vLLM v1's ``vllm/v1/metrics/loggers.py``): the same
metric names, label names ``model_name`` and ``engine`` (always "0" here), and the same
histogram buckets, so existing dashboards work. prometheus_client appends ``_total`` to
counters on exposition, as in vLLM (``vllm:prompt_tokens`` is scraped as
``vllm:prompt_tokens_total``). Request histograms are observed when a request finishes,
from its server-side RequestTimeline (vocab.py defines the phase durations).

Speculative decoding: vLLM's ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens`` and ``..._num_accepted_tokens_per_pos`` (label ``position``,
0-based), counted from each finished request's ``RequestTimeline.spec`` (so a request
counts once it ends, aborts included). Like vLLM, they appear only once speculation ran.

Engine death: ``servelab:engine_alive`` drops from 1 to 0 and the state gauges (running,
waiting, KV usage and blocks used) read 0 from then on: nothing runs on a dead engine, and
a scrape must not show its last state as live.

To extend (KV transfer): add the metric in ``ServerMetrics.__init__`` and
an ``observe_*``/``update_*`` method fed from ``EngineClient``; nothing else changes.
"""

from __future__ import annotations

import itertools
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from servelab.vocab import FinishReason, RequestTimeline

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM v1's buckets, so that histograms from both servers compare bucket by bucket.
# Both token-latency scales step from 0.5 s to 80 s alike.
_HALF_TO_80_S = (0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TTFT_BUCKETS = (
    (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25) + _HALF_TO_80_S + (160.0, 640.0, 2560.0)
)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4) + _HALF_TO_80_S
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# servelab's own latencies are sub-millisecond to seconds.
FINE_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

_COUNTER_STATS = {  # EngineStats field -> the counter it feeds (engine totals -> deltas)
    "num_preemptions": "preemptions",
    "prefix_cache_queries": "prefix_queries",
    "prefix_cache_hits": "prefix_hits",
    "evictions": "evictions",
}


class ServerMetrics:
    """All metrics of one server, in a private registry (several servers can share a process)."""

    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # vLLM does too: no `_created` series next to each counter
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        values = (model_name, "0")
        r = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, labels, registry=r, buckets=buckets).labels(*values)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=r).labels(*values)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=r).labels(*values)

        # --- vLLM: request histograms ---
        self.ttft = hist(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = hist(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.tpot = hist(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            ITL_BUCKETS,
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_BUCKETS,
        )
        self.queue = hist(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_BUCKETS,
        )
        self.prefill = hist(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_BUCKETS,
        )
        self.decode = hist(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_BUCKETS,
        )
        self.inference = hist(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_BUCKETS,
        )
        self.req_prompt = hist(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS
        )
        self.req_gen = hist(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            TOKEN_BUCKETS,
        )
        self.iteration_tokens = hist(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            TOKEN_BUCKETS,
        )
        # --- vLLM: scheduler and cache state ---
        self.running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.success = {
            reason.value: success.labels(*values, reason.value) for reason in FinishReason
        }
        # --- servelab ---
        self.kv_blocks_used = gauge(
            "servelab:kv_cache_blocks_used", "KV blocks referenced by requests."
        )
        self.kv_blocks_total = gauge("servelab:kv_cache_blocks_total", "KV blocks in the pool.")
        self.engine_alive = gauge(
            "servelab:engine_alive", "1 while the engine can serve, 0 once it died."
        )
        self.engine_alive.set(1)
        self._alive = True
        self.evictions = counter(
            "servelab:prefix_cache_evictions", "Cached KV blocks evicted (LRU)."
        )
        self.step_time = hist(
            "servelab:step_duration_seconds", "Engine step wall time.", FINE_BUCKETS
        )
        self.step_prefill = hist(
            "servelab:step_prefill_tokens",
            "Prefill tokens computed per engine step.",
            TOKEN_BUCKETS,
        )
        self.step_decode = hist(
            "servelab:step_decode_seqs", "Sequences decoding per engine step.", TOKEN_BUCKETS
        )
        self.api_to_core = hist(
            "servelab:api_to_core_seconds",
            "HTTP request arrival at the API to add_request in the engine core.",
            FINE_BUCKETS,
        )
        self.core_to_api = hist(
            "servelab:core_to_api_seconds",
            "Step outputs sent by the engine core to received by the API.",
            FINE_BUCKETS,
        )
        self.loop_lag = hist(
            "servelab:api_event_loop_lag_seconds",
            "Lateness of a periodic timer in the API event loop.",
            FINE_BUCKETS,
        )
        self.core_busy = counter(
            "servelab:engine_core_busy_seconds",
            "Engine-core time spent stepping or handling input.",
        )
        self.core_idle = counter(
            "servelab:engine_core_idle_seconds", "Engine-core time spent waiting for input."
        )
        self._rejected = Counter(
            "servelab:requests_rejected",
            "Requests answered with an error status.",
            [*labels, "status"],
            registry=r,
        )
        self._labels = values
        self._totals: dict[str, float] = {}
        self._spec: dict[str, Any] | None = None  # created at the first speculative request

    def set_baseline(self, stats: dict[str, Any]) -> None:
        """Engine totals at `ready` (after warm-up): counters count from there."""
        self._totals = {k: stats.get(k, 0) for k in _COUNTER_STATS}
        self._totals.update(busy=0.0, idle=0.0)
        self.update_engine(stats, 0.0, 0.0)

    def update_engine(self, stats: dict[str, Any], busy: float, idle: float) -> None:
        """Engine stats (EngineStats as a dict) and the core's cumulative busy/idle seconds."""
        if not self._alive:
            return  # a batch still queued behind the engine's death: its state is gone
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        self.kv_usage.set(stats["kv_usage"])
        self.kv_blocks_used.set(stats["kv_blocks_used"])
        self.kv_blocks_total.set(stats["kv_blocks_total"])
        for key, attr in _COUNTER_STATS.items():
            self._inc_to(getattr(self, attr), key, stats.get(key, 0))
        self._inc_to(self.core_busy, "busy", busy)
        self._inc_to(self.core_idle, "idle", idle)

    def engine_down(self) -> None:
        """The engine died: say so, and stop showing its last state as live."""
        self._alive = False
        self.engine_alive.set(0)
        for g in (self.running, self.waiting, self.kv_usage, self.kv_blocks_used):
            g.set(0)

    def _inc_to(self, counter: Any, key: str, total: float) -> None:
        delta = total - self._totals.get(key, 0)
        if delta > 0:
            counter.inc(delta)
            self._totals[key] = total

    def observe_step(self, record: dict[str, Any]) -> None:
        """One StepRecord (as a dict)."""
        self.step_time.observe(record["end"] - record["start"])
        self.step_prefill.observe(record["prefill_tokens"])
        self.step_decode.observe(record["decode_seqs"])
        self.iteration_tokens.observe(record["prefill_tokens"] + record["decode_seqs"])

    def observe_tokens(self, new_prompt_tokens: int, new_output_tokens: int) -> None:
        if new_prompt_tokens:
            self.prompt_tokens.inc(new_prompt_tokens)
        if new_output_tokens:
            self.generation_tokens.inc(new_output_tokens)

    def _spec_counters(self) -> dict[str, Any]:
        if self._spec is None:
            labels, r, values = ["model_name", "engine"], self.registry, self._labels
            self._spec = {
                name: Counter(f"vllm:spec_decode_{name}", doc, labels, registry=r).labels(*values)
                for name, doc in (
                    ("num_drafts", "Number of spec decoding drafts."),
                    ("num_draft_tokens", "Number of draft tokens."),
                    ("num_accepted_tokens", "Number of accepted tokens."),
                )
            }
            self._spec["per_pos"] = Counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                [*labels, "position"],
                registry=r,
            )
        return self._spec

    def observe_spec(self, tl: RequestTimeline) -> None:
        """The speculative proposals of a finished request (vLLM's spec_decode counters)."""
        proposals = [s for s in tl.spec if s.proposed]
        if not proposals:
            return
        c = self._spec_counters()
        c["num_drafts"].inc(len(proposals))
        c["num_draft_tokens"].inc(sum(s.proposed for s in proposals))
        c["num_accepted_tokens"].inc(sum(s.accepted for s in proposals))
        for s in proposals:
            for pos in range(s.proposed):  # a proposed position shows 0 until one is accepted
                child = c["per_pos"].labels(*self._labels, str(pos))
                if pos < s.accepted:
                    child.inc()

    def observe_finished(self, tl: RequestTimeline) -> None:
        """A request the engine finished (aborts included): its finish reason, its
        speculative proposals, and the phase durations of the ones that completed."""
        reason = tl.finish_reason.value if tl.finish_reason else FinishReason.ERROR.value
        self.success[reason].inc()
        self.observe_spec(tl)
        if reason not in (FinishReason.STOP.value, FinishReason.LENGTH.value):
            return
        self.req_prompt.observe(tl.prompt_tokens)
        self.req_gen.observe(tl.output_tokens)
        if tl.finished is not None:
            self.e2e.observe(tl.finished - tl.arrival)
        if tl.first_token is None:
            return
        self.ttft.observe(tl.first_token - tl.arrival)
        self.queue.observe(tl.queue_time)
        self.prefill.observe(tl.prefill_time)
        self.decode.observe(tl.decode_time)
        self.inference.observe(tl.prefill_time + tl.decode_time)
        # Tokens of one step share a timestamp: an ITL is a gap between distinct emissions.
        times = sorted(set(tl.token_times))
        for a, b in itertools.pairwise(times):
            self.itl.observe(b - a)
        if tl.output_tokens > 1 and tl.finished is not None:
            self.tpot.observe((tl.finished - tl.first_token) / (tl.output_tokens - 1))

    def observe_rejected_by_engine(self) -> None:
        """A request the engine refused at add_request (it has no timeline)."""
        self.success[FinishReason.ERROR.value].inc()

    def observe_rejected(self, status: int) -> None:
        """A request answered with an error status (bad input, auth, full queue...)."""
        self._rejected.labels(*self._labels, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
