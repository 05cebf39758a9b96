"""What the driver and its workers say to each other.

Driver -> worker (calls on a ``BenchWorkerCore``, over a socket or as Ray actor methods):
``ping`` (clock), ``setup(StageJob)``, ``feed(sessions, end)``, ``start(at)``, ``stop``.
Worker -> driver: batches of events, in order, ending with one ``DONE`` or ``FAILED``:

- ``(SENT, [(request_id, t), ...])``: requests handed to the connection (worker clock);
- ``(RECORDS, [ClientRecord, ...])``: finished requests (worker clock);
- ``(DONE, StageDone)``: the stage is over; its health and counts;
- ``(FAILED, text)``: the worker's stage raised; the text says what.

Local worker processes frame each message as a 4-byte length and a pickle. Pickle is
only ever read from the driver's own child processes over a socket pair.
"""

from __future__ import annotations

import asyncio
import pickle
from dataclasses import dataclass, field
from typing import Any

from servelab.bench.client.monitor import ClientHealth
from servelab.bench.workloads.request_plan import LoadSpec, PlannedRequest

SENT = "sent"
RECORDS = "records"
DONE = "done"
FAILED = "failed"

_HEADER = 4
_MAX_MESSAGE = 1 << 31


@dataclass(kw_only=True)
class StageJob:
    """One worker's part of a stage.

    ``load`` carries the worker's own share of a closed loop's concurrency. ``share`` is
    the worker's whole sub-plan (whole sessions); with ``fed`` the worker's closed loop
    instead takes sessions from ``feed()`` calls while it runs (a plan bounded only by
    time has no end to partition).
    """

    load: LoadSpec
    run_tag: str
    stage: str | None
    share: list[PlannedRequest] = field(default_factory=list)
    fed: bool = False


@dataclass(kw_only=True)
class StageDone:
    """The last event of a worker's stage (times on the worker's clock)."""

    start: float
    end: float
    sent: int
    interrupted: bool
    health: ClientHealth
    stamping: str
    late_start_s: float  # how far past the common start the worker began (0: on time)
    feed_wait_s: float  # closed loop fed by the driver: time its streams waited for sessions


@dataclass(kw_only=True)
class WorkerInfo:
    """Who a worker is, from its first ping."""

    index: int
    pid: int
    host: str
    boot_id: str | None

    def describe(self) -> str:
        return f"worker {self.index} (pid {self.pid} on {self.host})"


def encode(msg: Any) -> bytes:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(_HEADER, "big") + data


async def read_message(reader: asyncio.StreamReader) -> Any | None:
    """The next message, or None when the other side has gone (EOF, reset)."""
    try:
        head = await reader.readexactly(_HEADER)
        n = int.from_bytes(head, "big")
        if n > _MAX_MESSAGE:
            raise ValueError(f"a {n}-byte message: the worker channel is out of step")
        return pickle.loads(await reader.readexactly(n))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


class WorkerLost(Exception):
    """A worker died or can no longer be reached; the message says which and how."""


class WorkerCalls:
    """The driver's calls on one worker, over whatever ``_call(op, *args)`` a handle
    provides (a socket to a local process, or a Ray actor method)."""

    async def _call(self, op: str, *args: Any) -> Any:
        raise NotImplementedError

    async def ping(self) -> tuple[float, str | None]:
        return await self._call("ping")

    async def setup(self, job: StageJob) -> None:
        await self._call("setup", job)

    async def feed(self, sessions: list[list[PlannedRequest]], end: bool = False) -> None:
        await self._call("feed", sessions, end)

    async def start(self, at: float) -> None:
        await self._call("start", at)

    async def stop(self) -> None:
        await self._call("stop")
