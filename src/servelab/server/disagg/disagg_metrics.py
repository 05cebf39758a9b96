"""Prometheus metrics of disaggregated serving, in the server's registry (``servelab:``).

- ``servelab:kv_transfer_seconds``: prefill worker starts reading a request's blocks to the
  decode worker having written them (same host: one monotonic clock).
- ``servelab:kv_transfer_bytes``/``_blocks``: what crossed; ``_skipped_blocks``: blocks not
  sent because the decode worker had them in its prefix cache.
- ``servelab:kv_transfers{result}``: ``ok`` or ``failed``; ``servelab:kv_transfer_failures
  {reason}``: ``timeout``, ``send``, ``receive``, ``corrupt``, ``worker_died``, ``refused``.
- ``servelab:kv_handoff_wait_seconds``: first token out to the transfer starting (waiting for
  a decode worker with free blocks, and the reservation round trip).
- ``servelab:disagg_requests{stage}``: requests in each stage now (held at the router,
  prefill, handoff, transfer, decode).
- ``servelab:disagg_worker_*{worker,role}``: each worker's liveness, KV blocks and queue.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from servelab.server.metrics import FINE_BUCKETS

STAGES = ("held", "prefill", "handoff", "transfer", "decode")


class DisaggMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name", "engine"]
        self._values = (model_name, "0")
        v = self._values

        def fine_histogram(name: str, doc: str) -> Any:
            return Histogram(name, doc, labels, registry=registry, buckets=FINE_BUCKETS).labels(*v)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=registry).labels(*v)

        self.transfer_seconds = fine_histogram(
            "servelab:kv_transfer_seconds",
            "KV transfer time: prefill worker reads the blocks -> decode worker has written them.",
        )
        self.handoff_wait = fine_histogram(
            "servelab:kv_handoff_wait_seconds",
            "First token sampled -> KV transfer starts (decode room and reservation).",
        )
        self.bytes = counter("servelab:kv_transfer_bytes", "KV bytes sent to decode workers.")
        self.blocks = counter("servelab:kv_transfer_blocks", "KV blocks sent to decode workers.")
        self.skipped = counter(
            "servelab:kv_transfer_skipped_blocks",
            "KV blocks not sent because the decode worker had them cached.",
        )
        self._transfers = Counter(
            "servelab:kv_transfers",
            "KV transfers by result.",
            [*labels, "result"],
            registry=registry,
        )
        self._failures = Counter(
            "servelab:kv_transfer_failures",
            "Failed hand-offs by reason.",
            [*labels, "reason"],
            registry=registry,
        )
        self._stages = Gauge(
            "servelab:disagg_requests",
            "Requests in each stage of disaggregated serving.",
            [*labels, "stage"],
            registry=registry,
        )
        worker = [*labels, "worker", "role"]

        def worker_gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, worker, registry=registry)

        self._up = worker_gauge("servelab:disagg_worker_up", "1 while the worker runs.")
        self._used = worker_gauge("servelab:disagg_worker_kv_blocks_used", "KV blocks in use.")
        self._total = worker_gauge(
            "servelab:disagg_worker_kv_blocks_total", "KV blocks in the pool."
        )
        self._running = worker_gauge("servelab:disagg_worker_requests_running", "Requests running.")
        self._waiting = worker_gauge("servelab:disagg_worker_requests_waiting", "Requests waiting.")
        for stage in STAGES:
            self._stages.labels(*v, stage).set(0)

    def transfer_ok(self, seconds: float, nbytes: int, blocks: int, skipped: int) -> None:
        self.transfer_seconds.observe(max(0.0, seconds))
        self.bytes.inc(nbytes)
        self.blocks.inc(blocks)
        self.skipped.inc(skipped)
        self._transfers.labels(*self._values, "ok").inc()

    def transfer_failed(self, reason: str) -> None:
        self._transfers.labels(*self._values, "failed").inc()
        self._failures.labels(*self._values, reason).inc()

    def stages(self, counts: dict[str, int]) -> None:
        for stage in STAGES:
            self._stages.labels(*self._values, stage).set(counts.get(stage, 0))

    def worker(self, name: str, role: str, up: bool, stats: dict[str, Any] | None) -> None:
        key = (*self._values, name, role)
        self._up.labels(*key).set(1 if up else 0)
        s = stats if (up and stats) else {}
        self._used.labels(*key).set(s.get("kv_blocks_used", 0))
        self._total.labels(*key).set(s.get("kv_blocks_total", 0))
        self._running.labels(*key).set(s.get("num_running", 0))
        self._waiting.labels(*key).set(s.get("num_waiting", 0))
