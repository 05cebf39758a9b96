"""The wire format of disaggregated serving: router <-> workers, and the KV transfer header.

Workers speak the engine core's protocol (``server/ipc.py``: AddRequest, Abort,
UtilityCall, Shutdown in; StepBatch, UtilityResult, StartupFailed out) plus these
messages. msgspec msgpack, tagged by type, so one decoder reads a whole channel.

Hand-off of one request (prefill worker P, decode worker D, router R)::

    R -> D  ImportKV            at arrival: D checks the request and reserves its prompt's
    R -> P  AddRequest          blocks (reusing any it has cached: ``skip_blocks``) while P
    D -> R  KVEvents.reserved   prefills; or D refuses (no room: R holds or retries)
    R -> P  SendKV              usually reaches P before its prefill ends
    P -> R  KVEvents.parked     P sampled the first token (streamed at once), keeps the blocks
    P ~> D  KVHeader + blocks   at once when SendKV is there: blocks [skip_blocks:] with their
    P -> R  KVEvents.sent       chain hashes, the first token and the prefill timeline
    D -> R  KVEvents.imported   D wrote and registered the blocks; decoding continues on D

Any side that fails reports ``KVEvents.failed`` after freeing its own blocks; the router
then fails the request and aborts it on the other side.
"""

from __future__ import annotations

from typing import Any

import msgspec

from servelab.server import ipc

ROLES = ("prefill", "decode")
TRANSPORTS = ("shm", "socket")


class WorkerConfig(msgspec.Struct):
    """How to start one worker (JSON on its stdin). ``core`` is the engine core's config."""

    core: ipc.CoreConfig
    role: str  # "prefill" or "decode"
    index: int  # position among all workers (prefill first)
    name: str  # "prefill-0", "decode-1"...
    transport: str = "shm"
    kv_host: str = "127.0.0.1"  # socket transport: the decode worker binds and advertises this
    kv_dir: str = ""  # shm transport: where the notification sockets live
    session: str = ""  # names this server's shared-memory segments (for clean-up)
    transfer_timeout: float = 30.0  # prefill: unread shm segments are removed after this
    reservation_timeout: float = 660.0  # decode: a reservation without payload ends after this
    cpus: list[int] | None = None  # CPU affinity; None keeps the inherited one


class WorkerReady(msgspec.Struct, tag=True, array_like=True):
    info: ipc.CoreInfo
    stats: dict[str, Any]
    kv_address: str | None  # where a decode worker receives KV (None for prefill workers)
    cpus: list[int]


# ---- router -> worker ----------------------------------------------------------


class ImportKV(msgspec.Struct, tag=True, array_like=True):
    """Ask a decode worker to take a request over after its prefill: reserve its KV blocks."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    priority: int
    arrival_time: float
    prefill_worker: int


class SendKV(msgspec.Struct, tag=True, array_like=True):
    """Tell a prefill worker where to send a request's blocks ``[skip_blocks:]``: at once if
    it is parked, else as soon as it parks."""

    request_id: str
    address: str
    skip_blocks: int
    decode_worker: int


WorkerInput = ipc.AddRequest | ipc.Abort | ipc.UtilityCall | ipc.Shutdown | ImportKV | SendKV

# ---- worker -> router ----------------------------------------------------------


class Parked(msgspec.Struct, array_like=True):
    request_id: str
    first_token: int
    num_blocks: int  # blocks holding the prompt's KV
    parked_at: float
    timeline: dict[str, Any]


class Reserved(msgspec.Struct, array_like=True):
    request_id: str
    skip_blocks: int  # leading blocks the decode worker already holds (prefix cache)
    num_blocks: int


class Refused(msgspec.Struct, array_like=True):
    request_id: str
    retry: bool  # True: no room now (try later or elsewhere); False: the request is invalid
    error: str


class Sent(msgspec.Struct, array_like=True):
    request_id: str
    decode_worker: int
    nbytes: int
    num_blocks: int
    start: float  # before the blocks were read
    end: float  # handed to the transport


class Imported(msgspec.Struct, array_like=True):
    request_id: str
    nbytes: int
    num_blocks: int
    received: float  # the decode worker picked the payload up
    end: float  # blocks written and registered


class Failed(msgspec.Struct, array_like=True):
    request_id: str
    reason: str  # "timeout", "send", "receive", "corrupt"
    error: str


class KVEvents(msgspec.Struct, tag=True, array_like=True):
    """What a worker's hand-off machinery did in one loop iteration.

    ``stats`` are the worker's EngineStats after these events (a dict, as in StepBatch), so
    the router's view of a worker is never older than its last message.
    """

    stats: dict[str, Any]
    parked: list[Parked] = []
    reserved: list[Reserved] = []
    refused: list[Refused] = []
    sent: list[Sent] = []
    imported: list[Imported] = []
    failed: list[Failed] = []

    def __bool__(self) -> bool:
        return bool(
            self.parked
            or self.reserved
            or self.refused
            or self.sent
            or self.imported
            or self.failed
        )


WorkerOutput = WorkerReady | ipc.StartupFailed | ipc.StepBatch | ipc.UtilityResult | KVEvents

# ---- prefill worker ~> decode worker (the transport) ---------------------------


class KVHeader(msgspec.Struct, array_like=True):
    """Describes one transfer's payload: blocks ``[skip_blocks, skip_blocks + num_blocks)``
    of the request's block table, each ``block_shape`` of ``dtype``, laid out contiguously.

    ``block_hashes`` are the prefix-cache chain hashes of the transferred *full* blocks
    (the last block may be partial and has none); the receiver checks them against its own,
    so a block can only land where it belongs, and registers the blocks under them.
    ``first_token`` and ``timeline`` (the prefill side's RequestTimeline.to_dict()) complete
    the request on the decode side. ``segment`` names the shared-memory segment (shm only).
    """

    request_id: str
    first_token: int
    timeline: dict[str, Any]
    prefill_worker: int
    skip_blocks: int
    num_blocks: int
    block_hashes: list[int]
    dtype: str
    block_shape: list[int]
    nbytes: int
    sent_at: float
    segment: str = ""


_encoder = msgspec.msgpack.Encoder()
_worker_input = msgspec.msgpack.Decoder(WorkerInput)
_worker_output = msgspec.msgpack.Decoder(WorkerOutput)
_header = msgspec.msgpack.Decoder(KVHeader)


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


def decode_worker_input(data: bytes) -> Any:
    return _worker_input.decode(data)


def decode_worker_output(data: bytes) -> Any:
    return _worker_output.decode(data)


def decode_header(data: bytes) -> KVHeader:
    return _header.decode(data)
