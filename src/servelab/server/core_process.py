"""One engine-core child process and the two IPC channels to it, seen from the API process.

Contract:
- The constructor binds two ZeroMQ channels on ``ipc://`` paths in a private temp dir:
  ``inputs_addr`` (PUSH, API -> child) and ``outputs_addr`` (PULL, child -> API). The caller
  puts them into the child's config before ``start``.
- ``start(config_json)`` runs ``python -m <module>`` with the config on stdin and returns the
  child's first message, decoded with ``decode_output``; it raises CoreStartupError when the
  child exits first or sends ``StartupFailed``.
- ``send`` never blocks (no high-water mark); it raises EngineDeadError when no child is
  connected. ``recv`` awaits the next message.
- ``wait_exit`` awaits the child's exit code; ``stop`` asks it to shut down, kills it after
  ``timeout`` seconds, and releases the channels.

The single-core server (``EngineClient``) and the disaggregated router (one per worker)
both drive their children through this class.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from servelab.server import ipc

log = logging.getLogger("servelab.server")


class CoreStartupError(RuntimeError):
    """The engine core could not start (bad model path, bad config, out of memory...)."""


class EngineDeadError(RuntimeError):
    """The engine core is gone; the request cannot complete."""


class CoreProcess:
    """A child engine process and its IPC channels (see the module docstring)."""

    def __init__(
        self,
        module: str = "servelab.server.engine_core",
        decode_output: Callable[[bytes], Any] = ipc.decode_output,
        name: str = "engine core",
    ) -> None:
        self.module = module
        self.name = name
        self._decode = decode_output
        self.proc: asyncio.subprocess.Process | None = None
        self._tmpdir = tempfile.mkdtemp(prefix="servelab-ipc-")
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._out = self._actx.socket(zmq.PULL)
        self._in.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a send
        self._in.setsockopt(zmq.LINGER, 0)
        self._out.setsockopt(zmq.RCVHWM, 0)
        self._out.setsockopt(zmq.LINGER, 0)
        self.inputs_addr = f"ipc://{self._tmpdir}/inputs"
        self.outputs_addr = f"ipc://{self._tmpdir}/outputs"
        self._in.bind(self.inputs_addr)
        self._out.bind(self.outputs_addr)
        self._closed = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self, config_json: bytes) -> Any:
        """Launch the child and return its first message (see the module contract)."""
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", self.module, stdin=asyncio.subprocess.PIPE
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(config_json)
        await self.proc.stdin.drain()
        self.proc.stdin.close()
        recv = asyncio.ensure_future(self._out.recv())
        exited = asyncio.ensure_future(self.proc.wait())
        try:
            await asyncio.wait({recv, exited}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            recv.cancel()
            exited.cancel()
            raise
        if not recv.done():
            recv.cancel()
            raise CoreStartupError(
                f"the {self.name} exited with code {exited.result()} while starting"
            )
        exited.cancel()
        msg = self._decode(recv.result())
        if isinstance(msg, ipc.StartupFailed):
            raise CoreStartupError(msg.error)
        return msg

    async def recv(self) -> Any:
        return self._decode(await self._out.recv())

    async def wait_exit(self) -> int:
        assert self.proc is not None
        return await self.proc.wait()

    def send(self, msg: Any) -> None:
        """Encode and queue ``msg`` for the child; raises EngineDeadError if none is connected."""
        try:
            self._in.send(ipc.encode(msg), zmq.NOBLOCK)
        except zmq.Again as e:  # no connected child: it is exiting
            raise EngineDeadError(f"the {self.name} is not accepting requests") from e

    async def stop(self, timeout: float) -> None:
        """Ask the child to stop; kill it after ``timeout`` s."""
        if self.running:
            assert self.proc is not None
            with contextlib.suppress(zmq.ZMQError):
                self._in.send(ipc.encode(ipc.Shutdown()), zmq.NOBLOCK)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except asyncio.TimeoutError:
                log.warning("servelab serve: the %s did not stop; killing it", self.name)
                self.proc.kill()
                await self.proc.wait()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._in.close(0)
        self._out.close(0)
        self._ctx.term()
        self._actx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
