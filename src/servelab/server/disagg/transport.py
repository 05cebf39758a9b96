"""KV-cache transports: how a prefill worker's blocks reach a decode worker.

Interface (what a new transport, e.g. RDMA through NIXL or Mooncake, implements):

- ``KVReceiver`` (decode worker): ``address`` (what senders are told), ``socket`` (a ZeroMQ
  socket whose readability means "payloads may be ready": the worker's loop polls it),
  ``receive()`` (every payload that arrived, without blocking) and ``close()``.
- ``KVSender`` (prefill worker): ``send(address, header, blocks) -> bytes`` (raises
  TransferError; may return before the receiver has the data, and does not fail because the
  link is busy: such a transfer waits in ``backlog``), ``housekeeping(now)`` (moves the
  backlog on and removes what is past the transfer timeout; called every loop iteration)
  and ``close()``.
- A payload is ``Received(header, blocks, error, received_at)``: ``blocks`` are views of
  ``[block_shape]`` tensors on the received memory, valid until ``release()``.

The header (``protocol.KVHeader``) always travels over a ZeroMQ PUSH/PULL channel; the bulk
data goes through shared memory (``shm``: one host, one copy in and one out) or in the same
ZeroMQ message over TCP (``socket``: any hosts; ZeroMQ's I/O threads move it while the decode
worker computes). An RDMA transport would register the receiver's staging memory, put the
remote key in the header and write with one-sided RDMA; the worker loop does not change.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import mmap
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import zmq

from servelab.server.disagg import shm
from servelab.server.disagg.wire import KVHeader, decode_header, encode
from servelab.server.disagg.worker_engine import TransferError

_SEND_HWM = 64  # transfers queued in ZeroMQ per destination; more wait in the sender's backlog
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Received:
    header: KVHeader
    blocks: list[torch.Tensor]
    error: str | None = None
    received_at: float = 0.0
    _release: Callable[[], None] | None = field(default=None, repr=False)

    def release(self) -> None:
        """Give the staging memory back (the block views are invalid afterwards)."""
        self.blocks = []
        if self._release is not None:
            self._release()
            self._release = None


class KVReceiver(Protocol):
    address: str
    socket: zmq.Socket

    def receive(self) -> list[Received]: ...

    def close(self) -> None: ...


class KVSender(Protocol):
    def send(self, address: str, header: KVHeader, blocks: list[torch.Tensor]) -> int: ...

    @property
    def backlog(self) -> int: ...

    def housekeeping(self, now: float) -> None: ...

    def close(self) -> None: ...


def _views(header: KVHeader, buf: memoryview | mmap.mmap) -> list[torch.Tensor]:
    """The header's blocks as tensors over ``buf`` (no copy)."""
    dtype = _DTYPES.get(header.dtype)
    if dtype is None:
        raise TransferError(f"unsupported KV dtype {header.dtype!r}")
    if len(buf) != header.nbytes:
        raise TransferError(f"payload has {len(buf)} bytes, header says {header.nbytes}")
    with warnings.catch_warnings():  # read-only buffers: the views are only read from
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buf, dtype=dtype) if header.nbytes else torch.empty(0, dtype=dtype)
    return list(flat.view(header.num_blocks, *header.block_shape).unbind(0))


def _pack_into(dst: torch.Tensor, blocks: list[torch.Tensor]) -> None:
    torch.stack([b.to("cpu") for b in blocks], out=dst.view(len(blocks), *blocks[0].shape))


class _PushPool:
    """One PUSH socket per destination address, created on first use.

    A transfer the socket cannot take now (its ``_SEND_HWM`` queue is full: ZeroMQ's I/O
    thread has not caught up with a step that parked many requests, or the receiver is slow
    or gone) waits in the destination's backlog, in order, instead of failing; ``flush``
    moves backlogged transfers on as the socket takes them and drops those older than
    ``timeout`` (by then the router has timed their transfers out). Every transfer was
    reserved by its decode worker first, so the backlog is bounded by the decode pools.
    """

    def __init__(self, ctx: zmq.Context, timeout: float) -> None:
        self._ctx = ctx
        self._timeout = timeout
        self._socks: dict[str, zmq.Socket] = {}
        self._backlog: dict[str, collections.deque[tuple[float, list[bytes | memoryview]]]] = {}

    def get(self, address: str) -> zmq.Socket:
        sock = self._socks.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(address)
            self._socks[address] = sock
        return sock

    def send(self, address: str, frames: list[bytes | memoryview]) -> None:
        waiting = self._backlog.get(address)
        if not waiting and self._try(address, frames):
            return
        self._backlog.setdefault(address, collections.deque()).append(
            (time.monotonic() + self._timeout, frames)
        )

    def _try(self, address: str, frames: list[bytes | memoryview]) -> bool:
        try:
            self.get(address).send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    @property
    def backlog(self) -> int:
        """Transfers waiting for their socket."""
        return sum(len(q) for q in self._backlog.values())

    def flush(self, now: float) -> None:
        for address, waiting in list(self._backlog.items()):
            while waiting and waiting[0][0] <= now:
                waiting.popleft()
            while waiting and self._try(address, waiting[0][1]):
                waiting.popleft()
            if not waiting:
                del self._backlog[address]

    def close(self) -> None:
        self._backlog.clear()
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()


# ---- socket (TCP, any hosts) -----------------------------------------------------


class SocketReceiver:
    """Header and blocks in one ZeroMQ message on a TCP port of ``host``."""

    def __init__(self, ctx: zmq.Context, host: str = "127.0.0.1") -> None:
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"

    def receive(self) -> list[Received]:
        out = []
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            now = time.monotonic()
            header = decode_header(frames[0].bytes)
            try:
                if len(frames) != 2:
                    raise TransferError(f"expected header and payload, got {len(frames)} frames")
                out.append(Received(header, _views(header, frames[1].buffer), None, now))
            except TransferError as e:
                out.append(Received(header, [], str(e), now))

    def close(self) -> None:
        self.socket.close()


class SocketSender:
    """Packs each transfer into one buffer; a backlogged one is dropped after ``timeout``."""

    def __init__(self, ctx: zmq.Context, timeout: float) -> None:
        self._push = _PushPool(ctx, timeout)

    def send(self, address: str, header: KVHeader, blocks: list[torch.Tensor]) -> int:
        payload = torch.empty(header.nbytes, dtype=torch.uint8)
        _pack_into(payload.view(blocks[0].dtype), blocks)
        self._push.send(address, [encode(header), memoryview(payload.numpy())])
        return header.nbytes

    @property
    def backlog(self) -> int:
        return self._push.backlog

    def housekeeping(self, now: float) -> None:
        self._push.flush(now)

    def close(self) -> None:
        self._push.close()


# ---- shared memory (one host) ----------------------------------------------------


class ShmReceiver:
    """Headers over a ZeroMQ ``ipc://`` socket in ``kv_dir``; blocks in ``/dev/shm`` segments."""

    def __init__(self, ctx: zmq.Context, kv_dir: str, name: str) -> None:
        shm.check_available()
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.address = f"ipc://{kv_dir}/kv-{name}"
        self.socket.bind(self.address)

    def receive(self) -> list[Received]:
        out = []
        while True:
            try:
                data = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            now = time.monotonic()
            header = decode_header(data)
            try:
                out.append(self._open(header, now))
            except (OSError, TransferError, ValueError) as e:
                out.append(Received(header, [], f"shared-memory segment unreadable: {e}", now))

    def _open(self, header: KVHeader, now: float) -> Received:
        path = shm.SHM_DIR / header.segment
        if path.parent != shm.SHM_DIR or not header.segment.startswith(shm.PREFIX):
            raise TransferError(f"segment name {header.segment!r} is not a servelab segment")
        fd = os.open(path, os.O_RDONLY)
        try:
            os.unlink(path)  # the mapping stays valid; nothing is left behind
            mm = mmap.mmap(fd, header.nbytes, prot=mmap.PROT_READ) if header.nbytes else None
        finally:
            os.close(fd)
        if mm is None:
            return Received(header, [], None, now)
        try:
            blocks = _views(header, mm)
        except TransferError:
            mm.close()
            raise

        def release() -> None:
            with contextlib.suppress(BufferError):  # a view still alive: the GC unmaps later
                mm.close()

        return Received(header, blocks, None, now, release)

    def close(self) -> None:
        self.socket.close()


class ShmSender:
    """Writes each transfer into a fresh segment; unlinks leftovers after ``timeout``."""

    def __init__(self, ctx: zmq.Context, session: str, worker: int, timeout: float) -> None:
        shm.check_available()
        self._push = _PushPool(ctx, timeout)
        self._session = session
        self._worker = worker
        self._timeout = timeout
        self._seq = itertools.count()
        self._segments: list[tuple[float, str]] = []  # (unlink deadline, path)

    def send(self, address: str, header: KVHeader, blocks: list[torch.Tensor]) -> int:
        path = shm.segment_path(self._session, self._worker, next(self._seq))
        header.segment = path.name
        self._write(str(path), header.nbytes, blocks)
        self._segments.append((time.monotonic() + self._timeout, str(path)))
        self._push.send(address, [encode(header)])
        return header.nbytes

    @staticmethod
    def _write(path: str, nbytes: int, blocks: list[torch.Tensor]) -> None:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)  # ENOSPC now, rather than SIGBUS on write
            except OSError as e:
                os.unlink(path)
                raise TransferError(
                    f"cannot allocate {nbytes} bytes in {shm.SHM_DIR}: {e}; free space there "
                    "or use --kv-transport socket"
                ) from e
            mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        try:
            dst = torch.frombuffer(mm, dtype=torch.uint8)
            _pack_into(dst.view(blocks[0].dtype), blocks)
            del dst
        finally:
            mm.close()

    @staticmethod
    def _unlink(path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    @property
    def backlog(self) -> int:
        return self._push.backlog

    def housekeeping(self, now: float) -> None:
        self._push.flush(now)
        while self._segments and self._segments[0][0] <= now:
            self._unlink(self._segments.pop(0)[1])

    def close(self) -> None:
        for _, path in self._segments:
            self._unlink(path)
        self._segments.clear()
        self._push.close()


def make_receiver(kind: str, ctx: zmq.Context, *, host: str, kv_dir: str, name: str) -> KVReceiver:
    if kind == "socket":
        return SocketReceiver(ctx, host)
    if kind == "shm":
        return ShmReceiver(ctx, kv_dir, name)
    raise ValueError(f"unknown KV transport {kind!r}: use shm or socket")


def make_sender(
    kind: str, ctx: zmq.Context, *, session: str, worker: int, timeout: float
) -> KVSender:
    if kind == "socket":
        return SocketSender(ctx, timeout)
    if kind == "shm":
        return ShmSender(ctx, session, worker, timeout)
    raise ValueError(f"unknown KV transport {kind!r}: use shm or socket")
