"""A benchmark worker: runs its share of each stage with the ordinary ``PlanRunner``.

``BenchWorkerCore`` is the worker itself, whatever carries its calls: a local child process
(``python -m servelab.bench.distributed.bench_worker --fd N``, driven over a socket pair by
``local.ProcessWorker``) or a Ray actor (``ray_workers``). Per stage the driver calls
``setup(job)``, optionally ``feed(...)``, then ``start(at)`` with the common start on
this worker's clock; the worker keeps its own self-check (``LoopMonitor``) and queues
events that ``next_batch()`` hands out in order: sends and records as they happen
(coalesced for ``FLUSH_S``), then one final ``DONE`` or ``FAILED``.

Every request this worker sends carries the header ``X-Servelab-Worker: <index>``, so a
server log can tell the client processes apart.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import signal
import socket
import time
import traceback
from dataclasses import replace
from typing import Any

from servelab.bench.client.event_loop import run_loop
from servelab.bench.client.http import HttpClient
from servelab.bench.client.monitor import LoopMonitor
from servelab.bench.client.send import Target
from servelab.bench.distributed.clock import boot_id
from servelab.bench.distributed.messages import (
    DONE,
    FAILED,
    RECORDS,
    SENT,
    StageDone,
    StageJob,
    WorkerInfo,
    encode,
    read_message,
)
from servelab.bench.plan_runner import PlanRunner, request_id
from servelab.bench.workloads.request_plan import PlannedRequest
from servelab.vocab import ClientRecord

WORKER_HEADER = "X-Servelab-Worker"
FLUSH_S = 0.02  # events that happen this close together travel in one message
_BOOT_ID = boot_id()


class SessionFeed:
    """Sessions handed over while a closed loop runs; many streams may wait on it at once.

    ``__anext__`` waits while it is empty and not closed; the time streams spent waiting
    is kept in ``wait_s`` (the driver fell behind: those streams were idle).
    """

    def __init__(self) -> None:
        self._queue: collections.deque[list[PlannedRequest]] = collections.deque()
        self._closed = False
        self._more = asyncio.Event()
        self.wait_s = 0.0

    def put(self, sessions: list[list[PlannedRequest]]) -> None:
        self._queue.extend(sessions)
        self._more.set()

    def close(self) -> None:
        self._closed = True
        self._more.set()

    def __aiter__(self) -> SessionFeed:
        return self

    async def __anext__(self) -> list[PlannedRequest]:
        while not self._queue:
            if self._closed:
                raise StopAsyncIteration
            self._more.clear()
            t = time.monotonic()
            await self._more.wait()
            self.wait_s += time.monotonic() - t
        return self._queue.popleft()


class BenchWorkerCore:
    """One worker's state across stages (see the module doc). Runs on the caller's loop."""

    def __init__(self, index: int, target: Target) -> None:
        self.index = index
        headers = {**target.extra_headers, WORKER_HEADER: str(index)}
        self.target = replace(target, extra_headers=headers)
        self.http = HttpClient(target.url)
        self._job: StageJob | None = None
        self._feed: SessionFeed | None = None
        self._task: asyncio.Task[None] | None = None
        self._sent: list[tuple[str, float]] = []
        self._records: list[ClientRecord] = []
        self._final: tuple[str, Any] | None = None
        self._over = True  # no stage events left to hand out
        self._wake = asyncio.Event()

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            index=self.index, pid=os.getpid(), host=socket.gethostname(), boot_id=_BOOT_ID
        )

    def ping(self) -> tuple[float, str | None]:
        return time.monotonic(), _BOOT_ID

    def setup(self, job: StageJob) -> None:
        if self._task is not None and not self._task.done():
            raise RuntimeError(f"worker {self.index}: a stage is still running")
        self._job = job
        self._feed = SessionFeed() if job.fed else None
        self._sent, self._records, self._final = [], [], None
        self._over = False

    def feed(self, sessions: list[list[PlannedRequest]], end: bool = False) -> None:
        if self._feed is None:
            raise RuntimeError(f"worker {self.index}: this stage takes no feed")
        self._feed.put(sessions)
        if end:
            self._feed.close()

    def start(self, at: float) -> None:
        """Begin the stage at ``at`` (this worker's monotonic clock)."""
        if self._job is None or self._over:
            raise RuntimeError(f"worker {self.index}: start() without setup()")
        self._task = asyncio.get_running_loop().create_task(self._run(self._job, at))

    def stop(self) -> None:
        """Interrupt the stage: requests in flight are recorded as aborted."""
        if self._task is not None:
            self._task.cancel()

    async def close(self) -> None:
        self.stop()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.http.close()

    # ------------------------------------------------------------------ events

    def _on_send(self, req: PlannedRequest) -> None:
        assert self._job is not None
        self._sent.append((request_id(self._job.run_tag, req), time.monotonic()))
        self._wake.set()

    def _on_record(self, rec: ClientRecord) -> None:
        self._records.append(rec)
        self._wake.set()

    async def next_batch(self) -> list[tuple[str, Any]] | None:
        """The next events of the current stage, in order; None once the final one is out."""
        if self._over:
            return None
        while not (self._sent or self._records or self._final):
            self._wake.clear()
            await self._wake.wait()
        if self._final is None:
            await asyncio.sleep(FLUSH_S)
        batch: list[tuple[str, Any]] = []
        if self._sent:
            batch.append((SENT, self._sent))
            self._sent = []
        if self._records:
            batch.append((RECORDS, self._records))
            self._records = []
        if self._final is not None:
            batch.append(self._final)
            self._final, self._over = None, True
        return batch

    async def _run(self, job: StageJob, at: float) -> None:
        try:
            late = max(0.0, time.monotonic() - at)
            runner = PlanRunner(
                self.http,
                self.target,
                job.load,
                run_tag=job.run_tag,
                stage=job.stage,
                on_send=self._on_send,
                on_record=self._on_record,
            )
            monitor = LoopMonitor()
            monitor.start()
            try:
                plan = self._feed if self._feed is not None else job.share
                result = await runner.run(plan, start_at=at)
            finally:
                await monitor.stop()
            done = StageDone(
                start=result.start,
                end=result.end,
                sent=result.sent,
                interrupted=result.interrupted,
                health=monitor.report(result.records, open_loop=not job.load.closed),
                stamping=self.http.stamping,
                late_start_s=late,
                feed_wait_s=self._feed.wait_s if self._feed is not None else 0.0,
            )
            self._final = (DONE, done)
        except Exception:  # noqa: BLE001 -- the driver records the share as lost, with this
            self._final = (FAILED, traceback.format_exc(limit=8))
        self._wake.set()


# ---------------------------------------------------------------------- a local process


async def serve(sock: socket.socket) -> None:
    """Answer the driver's calls on ``sock`` until it says ``close`` or goes away.

    A call is ``(op, seq, args)`` and gets ``("reply", seq, value)`` or ``("error", seq,
    text)``; stage events go out as ``("events", batch)``.
    """
    reader, writer = await asyncio.open_connection(sock=sock)
    core: BenchWorkerCore | None = None
    pump: asyncio.Task[None] | None = None

    async def forward(c: BenchWorkerCore) -> None:
        with contextlib.suppress(ConnectionError):  # the driver went away: nothing to tell
            while (batch := await c.next_batch()) is not None:
                writer.write(encode(("events", batch)))
                await writer.drain()

    def call(op: str, args: tuple[Any, ...]) -> Any:
        nonlocal core, pump
        if op == "init":
            core = BenchWorkerCore(*args)
            return core.info()
        if core is None:
            raise RuntimeError(f"{op!r} before init")
        if op == "start":
            core.start(*args)
            pump = asyncio.get_running_loop().create_task(forward(core))
            return None
        if op in ("ping", "setup", "feed", "stop"):
            return getattr(core, op)(*args)
        raise ValueError(f"unknown call {op!r}")

    try:
        while (msg := await read_message(reader)) is not None:
            op, seq, args = msg
            if op == "close":
                break
            try:
                writer.write(encode(("reply", seq, call(op, args))))
            except Exception as e:  # noqa: BLE001 -- the driver raises it on its side
                writer.write(encode(("error", seq, f"{type(e).__name__}: {e}")))
        if pump is not None:  # let the last events of a stopped stage go out
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(pump), 5.0)
    finally:
        if core is not None:
            await core.close()
        writer.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="A servelab bench worker (started by the driver).")
    ap.add_argument("--fd", type=int, required=True, help="the socket to the driver")
    args = ap.parse_args(argv)
    # Ctrl-C reaches the whole process group: the driver stops its workers in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_loop(serve(socket.socket(fileno=args.fd)))


if __name__ == "__main__":
    main()
