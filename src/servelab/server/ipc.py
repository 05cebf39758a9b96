"""The wire format between the API process and the engine-core process.

Two ZeroMQ PUSH/PULL channels, both bound by the API process on ``ipc://`` paths:
``inputs`` (API -> core: AddRequest, Abort, UtilityCall, Shutdown) and ``outputs``
(core -> API: Ready, StartupFailed, StepBatch, UtilityResult). Messages are msgspec
structs encoded as msgpack, tagged by type, so one decoder reads a whole channel.

Timestamps are ``time.monotonic()`` seconds (system-wide on Linux), so the two
processes' stamps subtract directly.
"""

from __future__ import annotations

from typing import Any

import msgspec

# ---- API -> core -------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    """One generation request, already tokenised and validated by the API process."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams fields
    priority: int
    arrival_time: float  # when the API process received the HTTP request


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag=True, array_like=True):
    """Ask the core to run one engine method (e.g. ``reset_prefix_cache``) between steps."""

    call_id: int
    method: str


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


InputMessage = AddRequest | Abort | UtilityCall | Shutdown

# ---- core -> API -------------------------------------------------------------


class CoreInfo(msgspec.Struct):
    """What the engine core resolved at start-up: the limits the API process validates
    against, also reported by ``GET /version``."""

    model: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    device: str
    torch_threads: int
    pid: int
    quantization: str = "none"  # the weights' mode: none (fp32), bf16, q8_0 or q4_1
    # The CPU kernels' build the core runs (kernel_build.isa(): "avx512vnni" runs q4_1 as
    # integer dots on 8-bit inputs, "avx512bf16" also takes bf16), or "" where none is loaded.
    cpu_kernels: str = ""
    # Every EngineConfig field as resolved (defaults, the model's limits, the KV pool size):
    # run manifests record this, so an old run never takes a newer version's defaults.
    engine_config: dict[str, Any] = {}


class Ready(msgspec.Struct, tag=True, array_like=True):
    info: CoreInfo
    stats: dict[str, Any]  # EngineStats after warm-up: the baseline for counters


class StartupFailed(msgspec.Struct, tag=True, array_like=True):
    error: str


class Output(msgspec.Struct, array_like=True):
    """One RequestOutput. ``timeline`` (RequestTimeline.to_dict()) only once finished."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    timeline: dict[str, Any] | None = None
    error: str | None = None
    error_status: int = 500  # HTTP status for ``error``: 400 when the engine rejected the input


class StepBatch(msgspec.Struct, tag=True, array_like=True):
    """Everything one loop iteration of the core produced.

    ``record`` is the StepRecord of the step (None when the iteration only handled
    inputs). ``add_delays`` are, for each request added in this iteration, the seconds
    from its arrival at the API to ``add_request`` in the core. ``busy``/``idle`` are
    the core's cumulative seconds working and waiting for input.
    """

    outputs: list[Output]
    record: dict[str, Any] | None
    stats: dict[str, Any]
    add_delays: list[float]
    added_total: int  # AddRequests the core has handled so far (accepted or rejected)
    busy: float
    idle: float
    sent_at: float


class UtilityResult(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    result: Any = None
    error: str | None = None


OutputMessage = Ready | StartupFailed | StepBatch | UtilityResult

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(InputMessage)
_output_decoder = msgspec.msgpack.Decoder(OutputMessage)


def encode(msg: InputMessage | OutputMessage) -> bytes:
    return _encoder.encode(msg)


def decode_input(data: bytes) -> InputMessage:
    return _input_decoder.decode(data)


def decode_output(data: bytes) -> OutputMessage:
    return _output_decoder.decode(data)


class CoreConfig(msgspec.Struct):
    """How to start the engine core (sent as JSON on its stdin). Never holds the API key."""

    model: str
    engine: dict[str, Any]  # EngineConfig fields
    inputs_addr: str
    outputs_addr: str
    device: str | None = None
    torch_threads: int = 1
    quantization: str = "none"  # servelab.model.quant.MODES
    log_level: str = "info"
    simulate: str | None = None  # HARDWARE:MODEL: simulated timings (servelab.sim.realtime)
    # "module:function" returning an engine; tests pass a fake to test the processes and IPC.
    engine_factory: str = "servelab.server.engine_core:build_engine"
