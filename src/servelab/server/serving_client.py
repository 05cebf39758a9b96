"""What the HTTP layer needs of whatever serves its requests.

Two clients implement it: ``engine_client.EngineClient`` (one engine-core process over
ZeroMQ) and ``disagg.router.DisaggClient`` (prefill and decode workers behind a router). The
API process (``api.py``) and the server's start-up (``main.py``) speak to this protocol only.

Contract:
- ``start()`` returns once the engine can take requests (its resolved ``info``); ``shutdown()``
  stops it and fails every open stream.
- ``submit(req)`` returns the request's stream at once; every stream ends, with the request's
  last output or with a failure. ``abort(id)`` frees its KV blocks on every engine it touched.
- ``alive`` turns False, with ``dead_reason`` set, when an engine process dies; every open
  stream then fails with that reason and every later call raises ``EngineDeadError``.
- ``metrics`` and ``timelines`` are the stores ``/metrics`` and ``/v1/timelines`` read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from servelab.server import ipc
    from servelab.server.engine_client import RequestStream
    from servelab.server.metrics import ServerMetrics
    from servelab.server.timelines import TimelineStore


class ServingClient(Protocol):
    info: ipc.CoreInfo | None
    dead_reason: str | None
    metrics: ServerMetrics
    timelines: TimelineStore

    @property
    def alive(self) -> bool: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_in_flight(self) -> int: ...

    async def start(self) -> ipc.CoreInfo: ...

    async def shutdown(self) -> None: ...

    def has_request(self, request_id: str) -> bool: ...

    def submit(self, req: ipc.AddRequest) -> RequestStream: ...

    def abort(self, request_id: str) -> None: ...

    def abort_all(self) -> int: ...

    async def call(self, method: str) -> Any: ...
