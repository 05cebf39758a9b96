"""The one vocabulary of servelab (see docs/design/overview.md, "One vocabulary").

Every part -- engine, server, benchmark client, analysis, report, simulator -- speaks
in these names. This module imports nothing heavy (no torch, no numpy) so that any
layer can use it.

Clocks: every timestamp is seconds from ``time.monotonic()``. On Linux that clock is
system-wide, so a server timeline and a client record taken on the same host can be
joined exactly by request id. Across hosts only durations are comparable.
"""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_MODEL = "smollm2-135m"  # the model every command uses when none is named
# The servelab engine's token budget of one step (``max_num_batched_tokens``) when none is set.
DEFAULT_TOKEN_BUDGET = 2048
# The weight modes `serve`/`generate` offer: fp32, bf16 (on AVX512-BF16 CPUs), or the GGUF's
# own Q4_1 blocks. q8_0 exists in the model layer but misses its quality bar
# (docs/design/model.md), so it is not offered.
QUANTIZATION_MODES = ("none", "bf16", "q4_1")


def check_quantization(mode: str) -> None:
    """Raise ValueError, naming the offered modes, when ``mode`` is not one of them."""
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"--quantization {mode!r}: use {', '.join(QUANTIZATION_MODES)}")


# What an engine of a deployment does: serves whole requests, or one half of disaggregated
# serving. Step records and timelines carry it with the engine's ``replica`` index, so two
# engines' steps are never read as one engine's.
COLOCATED, PREFILL_ROLE, DECODE_ROLE = "colocated", "prefill", "decode"
ROLES = (COLOCATED, PREFILL_ROLE, DECODE_ROLE)


class Phase(str, enum.Enum):
    """Server-side request lifecycle: QUEUED -> PREFILL (chunks) -> DECODE -> FINISHED.

    A preempted request goes back to QUEUED and its KV cache is recomputed.
    """

    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached, or the context is full
    ABORT = "abort"  # the client went away or the request was cancelled
    ERROR = "error"  # the engine failed the request


@dataclass
class PrefillChunk:
    """One prefill chunk of one request, as executed in one engine step."""

    step_id: int
    start: float  # step start
    end: float  # step end
    tokens: int  # prompt tokens computed in this chunk
    cached_tokens: int = 0  # prompt tokens skipped thanks to the prefix cache (first chunk only)


@dataclass
class SpecRecord:
    """Speculative tokens for one request in one step."""

    step_id: int
    proposed: int
    accepted: int


@dataclass
class RequestTimeline:
    """What happened to one request inside the server.

    ``queued`` holds every time the request entered the waiting queue: arrival,
    and again after each preemption. ``token_times`` holds one entry per emitted
    output token (several tokens of one step share a timestamp).
    """

    request_id: str
    arrival: float
    priority: int = 0
    prompt_tokens: int = 0
    queued: list[float] = field(default_factory=list)
    scheduled: list[float] = field(default_factory=list)  # each admission from the queue
    chunks: list[PrefillChunk] = field(default_factory=list)
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    preemptions: list[float] = field(default_factory=list)
    spec: list[SpecRecord] = field(default_factory=list)
    finished: float | None = None
    finish_reason: FinishReason | None = None
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (sum over admissions)
    error: str | None = None
    replica: int = 0  # the engine that admitted and prefilled it: (role, replica)
    role: str = COLOCATED
    decode_replica: int | None = None  # disaggregated: the decode engine that took it over
    # disaggregated: the KV hand-off as the router timed it (``seconds``, ``bytes``,
    # ``handoff_wait``: first token out -> transfer start, ...); None when colocated.
    kv_transfer: dict[str, Any] | None = None

    # Derived phase durations (seconds). Defined here once.
    @property
    def queue_time(self) -> float:
        """Arrival to the first admission (vLLM's request_queue_time_seconds)."""
        return (self.scheduled[0] - self.arrival) if self.scheduled else 0.0

    @property
    def prefill_time(self) -> float:
        """First admission to the first token (vLLM's request_prefill_time_seconds)."""
        if not self.scheduled or self.first_token is None:
            return 0.0
        return self.first_token - self.scheduled[0]

    @property
    def decode_time(self) -> float:
        """First token to finish (vLLM's request_decode_time_seconds)."""
        if self.first_token is None or self.finished is None:
            return 0.0
        return self.finished - self.first_token

    def to_dict(self) -> dict[str, Any]:
        # What asdict gives, built directly: asdict deep-copies every per-token time, which
        # cost a simulated whole-trace run several seconds. The lists are the only mutable
        # fields (of floats, or of flat dataclasses), so shallow copies are as independent.
        d = {name: getattr(self, name) for name in _TIMELINE_FIELDS}
        for name in _TIMELINE_LISTS:
            d[name] = list(d[name])
        d["chunks"] = [
            {
                "step_id": c.step_id,
                "start": c.start,
                "end": c.end,
                "tokens": c.tokens,
                "cached_tokens": c.cached_tokens,
            }
            for c in self.chunks
        ]
        d["spec"] = [
            {"step_id": s.step_id, "proposed": s.proposed, "accepted": s.accepted}
            for s in self.spec
        ]
        d["finish_reason"] = self.finish_reason.value if self.finish_reason else None
        d["queue_time"] = self.queue_time
        d["prefill_time"] = self.prefill_time
        d["decode_time"] = self.decode_time
        return d

    def summary(self) -> dict[str, Any]:
        """The compact phase timings returned to the client in the final chunk/response."""
        return {
            "request_id": self.request_id,
            "arrival": self.arrival,
            "queue_time": self.queue_time,
            "prefill_time": self.prefill_time,
            "decode_time": self.decode_time,
            "prefill_chunks": [[c.tokens, c.cached_tokens, c.end - c.start] for c in self.chunks],
            "cached_prompt_tokens": self.cached_tokens,
            "preemptions": len(self.preemptions),
            "finish_reason": self.finish_reason.value if self.finish_reason else None,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestTimeline:
        d = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        d["chunks"] = [PrefillChunk(**c) for c in d.get("chunks", [])]
        d["spec"] = [SpecRecord(**s) for s in d.get("spec", [])]
        if d.get("finish_reason") is not None:
            d["finish_reason"] = FinishReason(d["finish_reason"])
        return cls(**d)


_TIMELINE_FIELDS = tuple(RequestTimeline.__dataclass_fields__)
_TIMELINE_LISTS = ("queued", "scheduled", "token_times", "preemptions")


@dataclass
class StepRecord:
    """One engine step: what ran together, and how long it took.

    ``prefill`` maps request id -> prompt tokens computed in this step;
    ``decode`` lists the request ids that took a decode token. ``(role, replica)`` names the
    engine that ran it, among the replicas or disaggregated workers of one deployment.
    """

    step_id: int
    start: float
    end: float
    prefill_tokens: int = 0
    decode_seqs: int = 0
    prefill: dict[str, int] = field(default_factory=dict)
    decode: list[str] = field(default_factory=list)
    spec_proposed: int = 0
    spec_accepted: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_waiting: int = 0
    preempted: list[str] = field(default_factory=list)
    replica: int = 0
    role: str = COLOCATED

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepRecord:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True, kw_only=True)
class RequestTags:
    """What one request is, as its workload planned it: its class, its place in a session,
    the shared prefix it starts with, and how it is served. The plan sets them once and they
    travel unchanged to the request's ClientRecord; ``priority`` (lower is served first) and
    ``temperature`` (None: the run's or the server's) are sent but not recorded."""

    workload_class: str = "default"
    session_id: str | None = None
    turn: int = 0
    prefix_group: str | None = None
    stream: bool = True
    priority: int = 0
    temperature: float | None = None


@dataclass(kw_only=True)
class ClientRecord:
    """What the benchmark client saw of one request. One line of ``requests.jsonl``.

    Times are ``time.monotonic()`` seconds. ``chunk_times[i]`` is when the i-th
    token-bearing chunk arrived and ``chunk_tokens[i]`` how many output tokens it
    carried (several with speculative decoding). Chunks without tokens (role-only,
    usage-only) are not listed.
    """

    request_id: str
    workload_class: str
    intended_send: float
    actual_send: float
    input_tokens: int = 0
    output_tokens: int = 0
    token_source: str = "usage"  # "usage" (server) or "client" (re-count)
    client_output_tokens: int | None = None  # client re-count, for the disagreement check
    disputed_usage: int | None = (
        None  # a usage count the stream disproves (bench.client.usagecheck)
    )
    requested_output_tokens: int | None = None
    stream: bool = True
    first_byte: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    done: float | None = None
    status: int | None = None  # HTTP status
    error: str | None = None  # None means success
    session_id: str | None = None
    turn: int = 0
    prefix_group: str | None = None
    stage: str | None = None  # sweep stage label
    server_timeline: dict[str, Any] | None = None  # the summary the server returned, if any
    reasoning_tokens: int = 0  # output tokens streamed as reasoning (reasoning_content)
    first_output: float | None = None  # first token chunk that is not reasoning
    cached_tokens: int | None = None  # prompt tokens the server served from its prefix cache
    # The id sent in X-Request-Id (a UUID; None: sent without one), and the ids the server
    # gave back: its X-Request-Id response header and the response's (chunks') ``id``.
    sent_request_id: str | None = None
    server_request_id: str | None = None
    response_id: str | None = None
    # How the request reached the server (None in runs recorded before these were): over a
    # kept-alive connection or a new one, the new one's set-up (seconds of DNS, TCP connect,
    # TLS), when the connection was ready and when the request's last byte was written.
    new_connection: bool | None = None
    dns_time: float | None = None
    connect_time: float | None = None
    tls_time: float | None = None
    connected: float | None = None
    request_written: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    # --- metric definitions (docs/design/overview.md "Metrics"); matched to vLLM's bench definitions ---

    @property
    def ttft(self) -> float | None:
        """TTFT: actual send -> first chunk carrying an output token."""
        if not self.chunk_times:
            return None
        return self.chunk_times[0] - self.actual_send

    @property
    def ttft_intended(self) -> float | None:
        """TTFT from the intended send time: exposes the client's own queueing."""
        if not self.chunk_times:
            return None
        return self.chunk_times[0] - self.intended_send

    @property
    def ttfo(self) -> float | None:
        """TTFO: actual send -> first output token that is not reasoning (AIPerf's "time to
        first output token"). Without reasoning it equals TTFT."""
        if self.first_output is not None:
            return self.first_output - self.actual_send
        return self.ttft if self.reasoning_tokens == 0 else None

    @property
    def connection_wait(self) -> float | None:
        """Actual send -> a connection to send on (0 for a kept-alive one; a new one's set-up)."""
        return _span(self.actual_send, self.connected)

    @property
    def send_time(self) -> float | None:
        """Connection ready -> the request's last byte written."""
        return _span(self.connected, self.request_written)

    @property
    def server_to_first_token(self) -> float | None:
        """The request's last byte written -> its first token chunk: the client's view of the
        server's TTFT (with the network both ways)."""
        if self.request_written is None or not self.chunk_times:
            return None
        return self.chunk_times[0] - self.request_written

    @property
    def send_lag(self) -> float:
        """How late the client sent the request compared with the arrival schedule."""
        return self.actual_send - self.intended_send

    @property
    def itls(self) -> list[float]:
        """ITL: gaps between consecutive token-bearing chunks (vLLM's definition)."""
        # pairwise: the summary reads this three times per record, over millions of gaps.
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]

    @property
    def max_itl(self) -> float | None:
        """The request's longest ITL: the longest freeze a reader of its stream saw."""
        gaps = self.itls
        return max(gaps) if gaps else None

    @property
    def e2e(self) -> float | None:
        """E2E: actual send -> last byte."""
        return _span(self.actual_send, self.done)

    @property
    def tpot(self) -> float | None:
        """TPOT: (e2e - ttft) / (output_tokens - 1)."""
        if self.e2e is None or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @classmethod
    def for_request(
        cls,
        request_id: str,
        tags: RequestTags,
        *,
        stage: str | None,
        intended_send: float,
        actual_send: float,
        input_tokens: int,
        requested_output_tokens: int | None,
        error: str | None = None,
    ) -> ClientRecord:
        """The record of a planned request before anything arrived: its tags as planned, the
        sweep ``stage`` it ran in, and its send; every client (real, distributed, simulated)
        starts its records here."""
        return cls(
            request_id=request_id,
            workload_class=tags.workload_class,
            intended_send=intended_send,
            actual_send=actual_send,
            input_tokens=input_tokens,
            requested_output_tokens=requested_output_tokens,
            stream=tags.stream,
            error=error,
            session_id=tags.session_id,
            turn=tags.turn,
            prefix_group=tags.prefix_group,
            stage=stage,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ClientRecord:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


# Metric names as used in metrics.json, tables and the report.
LATENCY_METRICS = ("ttft", "ttfo", "ttft_intended", "itl", "tpot", "e2e")
PERCENTILES = (50, 90, 95, 99)


def _span(start: float | None, end: float | None) -> float | None:
    """``end - start``; None where either mark is missing (not recorded, or not reached)."""
    return None if start is None or end is None else end - start


def finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)
