"""One request's state at the disaggregated router: where it is (``RouterStage``), its decode
reservation (``Reserve``), the workers it touched and what its transfer recorded."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from servelab.server import ipc
from servelab.server.disagg import wire
from servelab.server.disagg.worker_pool import Worker
from servelab.server.engine_client import RequestStream


class RouterStage(str, enum.Enum):
    HELD = "held"  # at the router: no decode worker has room
    PREFILL = "prefill"  # on a prefill worker, before its first token
    HANDOFF = "handoff"  # parked on the prefill worker, no decode reservation yet
    TRANSFER = "transfer"  # parked, reservation asked or made: blocks about to move
    DECODE = "decode"  # decoding on a decode worker


class Reserve(str, enum.Enum):
    NONE = "none"  # waiting in the router's FIFO for decode room
    ASKED = "asked"  # ImportKV sent
    RESERVED = "reserved"  # blocks held on the decode worker; SendKV sent


@dataclass
class RouterRequest:
    add: ipc.AddRequest
    stream: RequestStream | None
    stage: RouterStage = RouterStage.HELD
    reserve: Reserve = Reserve.NONE
    prefill: int | None = None
    decode: int | None = None
    deadline: float = float("inf")
    parked: wire.Parked | None = None
    need_blocks: int = 0
    sent: bool = False  # the prefill worker has let go of the blocks
    aborting: bool = False
    transfer: dict[str, Any] = field(default_factory=dict)
    deferred: list[tuple[Worker, Any]] = field(default_factory=list)  # see _replay
    num_output_tokens: int = 0

    @property
    def rid(self) -> str:
        return self.add.request_id
