"""Local worker processes, seen from the driver.

``ProcessWorker.spawn(index, target)`` starts ``python -m servelab.bench.distributed.bench_worker``
with one end of a socket pair and talks to it with ``protocol`` messages: calls wait
for their reply; stage events arrive on their own and are queued for ``events()``. When
the socket closes the worker is gone: pending calls and ``events()`` raise
``WorkerLost`` saying how it ended (its exit code or the signal that killed it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

from servelab.bench.client.send import Target
from servelab.bench.distributed.messages import (
    DONE,
    FAILED,
    WorkerCalls,
    WorkerInfo,
    WorkerLost,
    encode,
    read_message,
)

EXIT_WAIT_S = 5.0


def _how_it_ended(code: int | None) -> str:
    if code is None:
        return "closed its channel"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


class ProcessWorker(WorkerCalls):
    """One local worker process (see the module doc)."""

    kind = "process"

    def __init__(
        self,
        index: int,
        proc: asyncio.subprocess.Process,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.index = index
        self.proc = proc
        self.info = WorkerInfo(index=index, pid=proc.pid, host=socket.gethostname(), boot_id=None)
        self._reader = reader
        self._writer = writer
        self._seq = itertools.count()
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._events: asyncio.Queue[list[tuple[str, Any]] | None] = asyncio.Queue()
        self.lost: str | None = None
        self._read_task = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def spawn(cls, index: int, target: Target) -> ProcessWorker:
        parent, child = socket.socketpair()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "servelab.bench.distributed.bench_worker",
                "--fd",
                str(child.fileno()),
                pass_fds=(child.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
            )
        finally:
            child.close()
        reader, writer = await asyncio.open_connection(sock=parent)
        worker = cls(index, proc, reader, writer)
        try:
            worker.info = await worker._call("init", index, target)
        except BaseException:
            await worker.close()
            raise
        return worker

    @property
    def alive(self) -> bool:
        return self.lost is None

    def describe(self) -> str:
        return self.info.describe()

    # ------------------------------------------------------------------ channel

    async def _read(self) -> None:
        while (msg := await read_message(self._reader)) is not None:
            if msg[0] == "events":
                self._events.put_nowait(msg[1])
                continue
            kind, seq, value = msg
            fut = self._pending.pop(seq, None)
            if fut is None or fut.done():
                continue
            if kind == "reply":
                fut.set_result(value)
            else:
                fut.set_exception(RuntimeError(f"{self.describe()}: {value}"))
        with contextlib.suppress(asyncio.TimeoutError):  # the exit follows the socket closely
            await asyncio.wait_for(self.proc.wait(), 1.0)
        self.lost = f"{self.describe()} {_how_it_ended(self.proc.returncode)}"
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(WorkerLost(self.lost))
        self._pending.clear()
        self._events.put_nowait(None)

    async def _call(self, op: str, *args: Any) -> Any:
        if self.lost is not None:
            raise WorkerLost(self.lost)
        seq = next(self._seq)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[seq] = fut
        self._writer.write(encode((op, seq, args)))
        return await fut

    # ------------------------------------------------------------------ the worker calls

    async def events(self) -> AsyncIterator[list[tuple[str, Any]]]:
        """The stage's event batches up to its final event; ``WorkerLost`` if it dies first."""
        while True:
            batch = await self._events.get()
            if batch is None:
                self._events.put_nowait(None)  # every later reader learns it too
                raise WorkerLost(self.lost or f"{self.describe()} is gone")
            yield batch
            if any(kind in (DONE, FAILED) for kind, _ in batch):
                return

    async def close(self) -> None:
        """Ask the process to exit; kill it if it has not within a few seconds."""
        if self.lost is None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                self._writer.write(encode(("close", next(self._seq), ())))
                await self._writer.drain()
        try:
            await asyncio.wait_for(self.proc.wait(), EXIT_WAIT_S)
        except asyncio.TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        self._writer.close()
        self._read_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._read_task
