"""The API process's handle on the engine-core process.

Contract:
- ``start()`` launches ``python -m servelab.server.engine_core``, binds the two IPC channels and
  returns once the core is ready (or raises CoreStartupError with the core's reason).
- ``submit()`` sends one request without blocking and returns its RequestStream; one
  receive task routes every output to its stream, so no HTTP handler ever waits on a
  step, only on its own stream.
- ``abort()`` forgets a stream and tells the core to free the request's KV blocks.
- When the core process exits unexpectedly, ``alive`` turns False at once (the exit is
  awaited, not polled) and every open stream fails with EngineDeadError.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from servelab.server import ipc
from servelab.server.core_process import CoreProcess, CoreStartupError, EngineDeadError
from servelab.server.metrics import ServerMetrics
from servelab.server.timelines import TimelineStore
from servelab.vocab import RequestTimeline

__all__ = ["CoreStartupError", "EngineClient", "EngineDeadError", "RequestStream"]

log = logging.getLogger("servelab.server")

CALL_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 10.0


class RequestStream:
    """Outputs of one request: pushed by the receive task, pulled by its HTTP handler."""

    __slots__ = ("_error", "_event", "_items", "finished", "request_id")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._items: list[ipc.Output] = []
        self._event = asyncio.Event()
        self._error: str | None = None
        self.finished = False

    def push(self, out: ipc.Output) -> None:
        self._items.append(out)
        self.finished = out.finished
        self._event.set()

    def fail(self, reason: str) -> None:
        self._error = reason
        self._event.set()

    async def get(self) -> list[ipc.Output]:
        """Every output that arrived since the last call (waits for at least one).

        A handler that fell behind gets several outputs at once and sends them as one
        chunk. Raises EngineDeadError once the queued outputs are consumed, if the core died.
        """
        while not self._items and self._error is None:
            self._event.clear()
            await self._event.wait()
        if self._items:
            items, self._items = self._items, []
            return items
        raise EngineDeadError(self._error)


class EngineClient:
    """Starts, feeds and watches the engine-core process (see the module docstring)."""

    def __init__(
        self,
        config: ipc.CoreConfig,
        metrics: ServerMetrics,
        timelines: TimelineStore,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self.metrics = metrics
        self.timelines = timelines
        self.clock = clock
        self.info: ipc.CoreInfo | None = None
        self.dead_reason: str | None = None
        self._core = CoreProcess()
        self._streams: dict[str, RequestStream] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._tasks: list[asyncio.Task[Any]] = []
        self._closing = False
        self._adds_sent = 0
        self._adds_seen = 0
        self._num_waiting = 0
        self._config.inputs_addr = self._core.inputs_addr
        self._config.outputs_addr = self._core.outputs_addr

    # ---- lifecycle ----

    @property
    def pid(self) -> int | None:
        return self._core.pid

    @property
    def alive(self) -> bool:
        return self._core.running and self.dead_reason is None

    async def start(self) -> ipc.CoreInfo:
        msg = await self._core.start(msgspec.json.encode(self._config))
        if not isinstance(msg, ipc.Ready):
            raise CoreStartupError(f"the engine core sent {type(msg).__name__} before Ready")
        self.info = msg.info
        self.metrics.set_baseline(msg.stats)
        self._tasks = [
            asyncio.create_task(self._receive_loop(), name="servelab-core-outputs"),
            asyncio.create_task(self._watch(), name="servelab-core-watch"),
        ]
        return msg.info

    async def shutdown(self) -> None:
        """Stop the core (politely, then by force) and release the IPC channels."""
        self._closing = True
        await self._core.stop(EXIT_TIMEOUT_S)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_all("the server is shutting down")
        self._core.close()

    async def _watch(self) -> None:
        code = await self._core.wait_exit()
        if self._closing:
            return
        self.dead_reason = f"the engine core process exited unexpectedly (exit code {code})"
        log.error("servelab serve: %s; /health now answers 503", self.dead_reason)
        self.metrics.engine_down()
        self._fail_all(self.dead_reason)

    def _fail_all(self, reason: str) -> None:
        for stream in self._streams.values():
            stream.fail(reason)
        self._streams.clear()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        self._calls.clear()

    # ---- requests ----

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission: the engine's queue plus adds still in transit."""
        return self._num_waiting + self._adds_sent - self._adds_seen

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._streams

    def submit(self, req: ipc.AddRequest) -> RequestStream:
        """Queue ``req`` for the core; raises EngineDeadError if the core is gone."""
        if not self.alive:
            raise EngineDeadError(self.dead_reason or "the engine core is not running")
        self._send(req)
        self._adds_sent += 1
        stream = RequestStream(req.request_id)
        self._streams[req.request_id] = stream  # no output can arrive before this: one thread
        return stream

    def abort(self, request_id: str) -> None:
        """Drop a request the client no longer waits for; the core frees its KV blocks."""
        stream = self._streams.pop(request_id, None)
        if stream is None or stream.finished:
            return
        if self.alive:
            with contextlib.suppress(EngineDeadError):  # a dying core frees everything anyway
                self._send(ipc.Abort([request_id]))

    def abort_all(self) -> int:
        """End every open request now with finish_reason "abort" (the server is stopping)."""
        ids = list(self._streams)
        for rid, stream in self._streams.items():
            stream.push(ipc.Output(rid, [], "", True, "abort", 0, 0))
        self._streams.clear()
        if ids and self.alive:
            with contextlib.suppress(EngineDeadError):
                self._send(ipc.Abort(ids))
        return len(ids)

    async def call(self, method: str) -> Any:
        """Run an engine utility method (e.g. ``reset_prefix_cache``) between two steps."""
        if not self.alive:
            raise EngineDeadError(self.dead_reason or "the engine core is not running")
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self._send(ipc.UtilityCall(call_id, method))
        try:
            return await asyncio.wait_for(fut, CALL_TIMEOUT_S)
        finally:
            self._calls.pop(call_id, None)

    def _send(self, msg: ipc.InputMessage) -> None:
        self._core.send(msg)

    # ---- outputs ----

    async def _receive_loop(self) -> None:
        while True:
            msg = await self._core.recv()
            if isinstance(msg, ipc.StepBatch):
                self._on_batch(msg)
            elif isinstance(msg, ipc.UtilityResult):
                fut = self._calls.get(msg.call_id)
                if fut is not None and not fut.done():
                    if msg.error is None:
                        fut.set_result(msg.result)
                    else:
                        fut.set_exception(RuntimeError(msg.error))

    def _on_batch(self, batch: ipc.StepBatch) -> None:
        m = self.metrics
        m.core_to_api.observe(max(0.0, self.clock() - batch.sent_at))
        for delay in batch.add_delays:
            m.api_to_core.observe(max(0.0, delay))
        self._num_waiting = batch.stats["num_waiting"]
        self._adds_seen = batch.added_total
        m.update_engine(batch.stats, batch.busy, batch.idle)
        if batch.record is not None:
            m.observe_step(batch.record)
            self.timelines.add_step(batch.record)
        for out in batch.outputs:
            n_new = len(out.new_token_ids)
            first = n_new > 0 and out.num_output_tokens == n_new
            m.observe_tokens(out.num_prompt_tokens if first else 0, n_new)
            # Aborted requests are no longer in _streams, but their final output still
            # counts: the engine's timeline is the one record of how each request ended.
            stream = (
                self._streams.pop(out.request_id, None)
                if out.finished
                else self._streams.get(out.request_id)
            )
            if out.finished:
                if out.timeline is not None:
                    self.timelines.add_timeline(out.timeline)
                    m.observe_finished(RequestTimeline.from_dict(out.timeline))
                else:  # rejected by the engine before it had a timeline
                    m.observe_rejected_by_engine()
            if stream is not None:
                stream.push(out)
