"""A small HTTP/1.1 client for streamed responses that timestamps bytes on arrival.

Why not only aiohttp: the timestamp of a streamed chunk must be when its bytes reached
the host, not when a coroutine got around to reading them. Under hundreds of concurrent
streams, or on a machine whose cores are busy, those differ by milliseconds (the other
clients' inflated TTFTs in docs/reference-figures.md). On Linux, plain-HTTP connections are sockets
with ``SO_TIMESTAMPNS``: every ``recvmsg`` returns the kernel's receive time, which
no client-side delay can move. Elsewhere (TLS, other systems) the asyncio
``Protocol.data_received`` callback stamps each read with ``time.monotonic()`` before
anything else runs. HTTP framing, SSE parsing and JSON decoding happen later, off the
critical instant. Other requests (health, timelines, metrics) use aiohttp.

Contract: ``HttpClient.post_stream(path, body, headers, on_event, timeout)`` sends one
POST and calls ``on_event(t, payload)`` for each SSE ``data:`` payload (``t`` = arrival
of the read that completed the event); a non-SSE body is delivered whole as one
payload. It returns a ``StreamResult``; transport failures and timeouts are reported in
it, never raised. Connections are kept alive and reused, without a limit on how many are
open (a request never waits for a free one); the result says whether the request took a kept
connection or opened one, what that set-up cost, and when its last byte was written: a few
clock reads per request, nothing per chunk.

``warm(n, spare)`` opens connections before a measured window, so that its first requests do
not pay for their set-up, and keeps ``spare`` idle ones ready while it runs: a request that
takes one starts the opening of its replacement in the background, off any request's path.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from servelab.bench.client.kernelstamp import recv_stamped, stamp_receives

_READ_SIZE = 256 * 1024


class _Reads:
    """A queue of stamped reads that a coroutine awaits; the transport side fills it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.reads: deque[tuple[float, bytes]] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.closed = False
        self.error: BaseException | None = None

    def _push(self, t: float, data: bytes) -> None:
        self.reads.append((t, data))
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _close(self, exc: BaseException | None) -> None:
        self.closed = True
        self.error = self.error or exc
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def interrupt(self, exc: BaseException) -> None:
        """Make a pending ``read`` raise ``exc`` (used for timeouts)."""
        self.error = exc
        w = self.waiter
        if w is not None and not w.done():
            w.set_exception(exc)

    async def read(self) -> tuple[float, bytes] | None:
        """The next stamped read, or None once the peer closed and all was read."""
        if isinstance(self.error, TimeoutError):
            raise self.error
        while not self.reads:
            if self.closed:
                return None
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.reads.popleft()


class _Conn(_Reads, asyncio.Protocol):
    """A transport connection (TLS, or where kernel stamps are unavailable):
    ``data_received`` stamps each read with ``time.monotonic()`` before anything else."""

    kernel_stamps = False

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.transport: asyncio.Transport | None = None

    def data_received(self, data: bytes) -> None:
        self._push(time.monotonic(), data)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def eof_received(self) -> bool:
        self._close(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._close(exc)

    async def write(self, data: bytes) -> None:
        """Hand ``data`` to the transport (what the kernel did not take at once stays in its
        buffer, so the caller's "written" stamp is when the last byte was queued)."""
        assert self.transport is not None
        self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.closed = True


class _SockConn(_Reads):
    """A plain TCP socket read with ``recvmsg``: each read carries the kernel's receive
    time, converted to the monotonic clock, so a busy or descheduled client does not
    delay its stamps (only reads spanning several arrivals share the last one's time)."""

    kernel_stamps = True

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        super().__init__(loop)
        self.sock = sock
        loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        try:
            data, now, kernel = recv_stamped(self.sock, _READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._stop_reading()
            self._close(e)
            return
        if not data:
            self._stop_reading()
            self._close(None)
            return
        self._push(now if kernel is None else min(now, kernel), data)

    def _stop_reading(self) -> None:
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self.sock.fileno())

    async def write(self, data: bytes) -> None:
        await self.loop.sock_sendall(self.sock, data)

    def close(self) -> None:
        if self.sock.fileno() >= 0:
            self._stop_reading()
            self.sock.close()
        self.closed = True


async def _open_socket(
    host: str, port: int, res: StreamResult, stamped: bool
) -> tuple[socket.socket, bool]:
    """A connected non-blocking TCP socket with ``TCP_NODELAY``, trying each address in turn,
    and whether it has kernel receive stamps (asked for only when ``stamped``). Fills
    ``res.dns`` (name resolution) and ``res.connect`` (the TCP handshake)."""
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    t1 = time.monotonic()
    res.dns = t1 - t0
    error: OSError | None = None
    for family, type_, proto, _, addr in infos:
        sock = socket.socket(family, type_, proto)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            kernel = stamped and stamp_receives(sock)
            await loop.sock_connect(sock, addr)
        except OSError as e:
            sock.close()
            error = e
            continue
        except BaseException:
            sock.close()
            raise
        res.connect = time.monotonic() - t1
        return sock, kernel
    raise error or OSError(f"no address for {host}:{port}")


class ResponseParser:
    """Incremental HTTP/1.1 response parser: status, headers, then body pieces
    (chunked, content-length, or until close)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.done = False
        self.keep_alive = True
        self._state = "head"
        self._need = 0  # bytes left in the current chunk / the body
        self._until_close = False

    def feed(self, data: bytes) -> list[bytes]:
        """Consume ``data``; return the body bytes it completed, in order."""
        buf = self.buf
        buf += data
        out: list[bytes] = []
        pos, end = 0, len(buf)  # a read position: deleting from the front per chunk is quadratic
        while True:
            st = self._state
            if st == "data":
                if pos == end:
                    break
                take = min(self._need, end - pos)
                out.append(bytes(buf[pos : pos + take]))
                pos += take
                self._need -= take
                if self._need:
                    break
                self._state = "crlf"
            elif st == "crlf":
                if end - pos < 2:
                    break
                pos += 2
                self._state = "size"
            elif st == "size":
                i = buf.find(b"\r\n", pos)
                if i < 0:
                    break
                size = int(bytes(buf[pos:i]).split(b";", 1)[0], 16)
                pos = i + 2
                self._need = size
                self._state = "data" if size else "trailer"
            elif st == "head":
                i = buf.find(b"\r\n\r\n", pos)
                if i < 0:
                    break
                self._head(bytes(buf[pos:i]))
                pos = i + 4
            elif st == "trailer":
                i = buf.find(b"\r\n", pos)
                if i < 0:
                    break
                empty = i == pos
                pos = i + 2
                if empty:
                    self._finish()
                    break
            elif st == "body":
                if pos < end:
                    take = end - pos if self._until_close else min(self._need, end - pos)
                    out.append(bytes(buf[pos : pos + take]))
                    pos += take
                    self._need -= take
                if not self._until_close and self._need <= 0:
                    self._finish()
                break
            else:  # done
                break
        del buf[:pos]
        return out

    def _head(self, raw: bytes) -> None:
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/"):
            raise ValueError(f"not an HTTP response: {lines[0][:80]!r}")
        self.status = int(parts[1])
        for line in lines[1:]:
            k, _, v = line.partition(":")
            self.headers[k.strip().lower()] = v.strip()
        conn = self.headers.get("connection", "").lower()
        self.keep_alive = conn != "close" and parts[0] != "HTTP/1.0"
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            self._state = "size"
        elif "content-length" in self.headers:
            self._need = int(self.headers["content-length"])
            self._state = "body"
            if self._need == 0:
                self._finish()
        else:
            self._until_close = True
            self.keep_alive = False
            self._state = "body"

    def _finish(self) -> None:
        self._state = "done"
        self.done = True

    def eof(self) -> None:
        """The peer closed: a close-delimited body is complete now."""
        if self._until_close:
            self._finish()


class SSEParser:
    """Splits a byte stream into SSE events and returns their ``data`` payloads."""

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, piece: bytes) -> list[bytes]:
        # The common case, one whole "data: ..." event per piece, without the general split.
        if (
            not self.buf
            and piece.startswith(b"data: ")
            and piece.endswith(b"\n\n")
            and piece.find(b"\n") == len(piece) - 2
        ):
            return [piece[6:-2]]
        buf = self.buf + piece
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        out: list[bytes] = []
        start = 0
        while True:
            i = buf.find(b"\n\n", start)
            if i < 0:
                break
            data = [ln[5:] for ln in buf[start:i].split(b"\n") if ln.startswith(b"data:")]
            if data:
                payload = b"\n".join(data)
                out.append(payload[1:] if payload.startswith(b" ") else payload)
            start = i + 2
        self.buf = buf[start:]
        return out


@dataclass
class StreamResult:
    """What happened on the wire for one request (times are ``time.monotonic()``)."""

    sent: float = 0.0
    first_byte: float | None = None
    last_byte: float | None = None
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    complete: bool = False  # the whole body arrived
    error: str | None = None  # transport error or timeout (None: the exchange completed)
    events: int = 0
    # How the request reached the server (the attempt that got the answer): a connection
    # kept alive from an earlier request, or a new one with its set-up in seconds (DNS, TCP
    # connect, TLS handshake; None where not done); when the connection was ready; when the
    # request's last byte was handed to the kernel.
    new_connection: bool | None = None
    dns: float | None = None
    connect: float | None = None
    tls: float | None = None
    connected: float | None = None
    written: float | None = None


class HttpClient:
    """Keep-alive connections to one server; see the module contract."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        u = urlsplit(base_url if "://" in base_url else f"http://{base_url}")
        if u.scheme not in ("http", "https"):
            raise ValueError(f"--url must start with http:// or https://, got {base_url!r}")
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if u.scheme == "https" else None
        )
        self.prefix = u.path.rstrip("/")
        host_header = self.host if u.port is None else f"{self.host}:{self.port}"
        self._base_headers = {
            "Host": host_header,
            "User-Agent": "servelab-bench",
            **(headers or {}),
        }
        self._idle: list[_Conn | _SockConn] = []
        self.connections_opened = 0
        self._spare = 0  # idle connections to keep ready (warm)
        self._opening: set[asyncio.Task[None]] = set()  # their replacements being opened
        self.topped_up = 0  # connections the spare pool opened in the background
        self.kernel_stamps: bool | None = None  # known after the first connection

    @property
    def stamping(self) -> str:
        """How chunk arrival times are taken, for the manifest."""
        if self.kernel_stamps:
            return "kernel receive time (SO_TIMESTAMPNS)"
        return "user space, on read (asyncio data_received)"

    async def _connect(self, res: StreamResult) -> _Conn | _SockConn:
        """A new connection; its set-up times go to ``res`` (TLS: the handshake alone)."""
        loop = asyncio.get_running_loop()
        stamped = self.ssl is None and self.kernel_stamps is not False
        sock, kernel = await _open_socket(self.host, self.port, res, stamped)
        conn: _Conn | _SockConn
        try:
            if kernel:
                conn = _SockConn(loop, sock)
            else:
                t0 = time.monotonic()
                _, conn = await loop.create_connection(
                    lambda: _Conn(loop),
                    sock=sock,
                    ssl=self.ssl,
                    server_hostname=self.host if self.ssl is not None else None,
                )
                if self.ssl is not None:
                    res.tls = time.monotonic() - t0
        except BaseException:
            sock.close()
            raise
        self.kernel_stamps = conn.kernel_stamps
        self.connections_opened += 1
        return conn

    def _request_bytes(self, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        h = {**self._base_headers, **headers, "Content-Length": str(len(body))}
        lines = [f"POST {self.prefix}{path} HTTP/1.1"] + [f"{k}: {v}" for k, v in h.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    async def post_stream(
        self,
        path: str,
        body: bytes,
        headers: dict[str, str],
        on_event: Callable[[float, bytes], None],
        timeout: float | None = None,
        result: StreamResult | None = None,
    ) -> StreamResult:
        """POST ``body``; deliver SSE payloads (or the whole non-SSE body) to ``on_event``.

        ``result`` (optional) is filled in as the exchange goes, so a caller that is
        cancelled mid-stream still knows when it sent and what arrived.
        """
        raw = self._request_bytes(path, body, headers)
        res = result if result is not None else StreamResult()
        res.sent = time.monotonic()
        deadline = res.sent + timeout if timeout else None
        for attempt in (0, 1):
            conn = self._take_idle()
            reused = conn is not None
            res.new_connection = not reused
            res.dns = res.connect = res.tls = None
            try:
                if conn is None:
                    conn = await self._connect(res)
            except OSError as e:
                res.error = f"connection: cannot connect to {self.host}:{self.port}: {e}"
                return res
            res.connected = time.monotonic()
            timer = None
            if deadline is not None:
                timer = asyncio.get_running_loop().call_later(
                    max(0.0, deadline - time.monotonic()), conn.interrupt, TimeoutError()
                )
            try:
                got_any = await self._exchange(conn, raw, res, on_event)
            finally:
                if timer is not None:
                    timer.cancel()
            # A kept-alive connection the server had already closed: retry once, fresh.
            stale = res.error is not None and res.error != "timeout" and not got_any
            if stale and reused and attempt == 0:
                res.error = None
                continue
            return res
        return res

    async def open_connections(self, n: int) -> int:
        """Open up to ``n`` kept-alive connections now (before a measured window, so that its
        first requests do not pay for set-up); return how many opened."""
        got = await asyncio.gather(
            *(self._connect(StreamResult()) for _ in range(n)), return_exceptions=True
        )
        conns = [c for c in got if isinstance(c, (_Conn, _SockConn))]
        self._idle.extend(conns)
        return len(conns)

    async def warm(self, n: int, spare: int = 0) -> dict[str, float | int]:
        """Have ``n`` idle connections open (opening what is missing, at once), then keep
        ``spare`` idle ones ready until ``warm`` is called again or the client closes.
        Returns the set-up: how many were open already, opened, failed, and the seconds."""
        self._drop_closed()
        have = len(self._idle)
        t0 = time.monotonic()
        opened = await self.open_connections(max(0, n - have))
        self._spare = spare
        return {
            "kept": have,
            "opened": opened,
            "failed": max(0, n - have - opened),
            "seconds": round(time.monotonic() - t0, 6),
        }

    async def cold(self) -> None:
        """Close the idle connections and keep none ready: every request opens its own
        until connections are kept alive again (set-up measured as part of TTFT)."""
        self._spare = 0
        for task in list(self._opening):
            task.cancel()
        await asyncio.gather(*self._opening, return_exceptions=True)
        self._close_idle()

    def _drop_closed(self) -> None:
        alive = [c for c in self._idle if not c.closed]
        for c in self._idle:
            if c.closed:
                c.close()
        self._idle = alive

    def _take_idle(self) -> _Conn | _SockConn | None:
        """A kept-alive connection the server has not closed meanwhile, if any; with a spare
        pool, its replacement starts opening in the background."""
        conn = None
        while self._idle:
            c = self._idle.pop()
            if not c.closed:
                conn = c
                break
            c.close()
        if self._spare and len(self._idle) + len(self._opening) < self._spare:
            task = asyncio.get_running_loop().create_task(self._top_up())
            self._opening.add(task)
            task.add_done_callback(self._opening.discard)
        return conn

    async def _top_up(self) -> None:
        try:
            conn = await self._connect(StreamResult())
        except OSError:
            return  # the next request that finds no idle connection opens its own, and says so
        self.topped_up += 1
        self._idle.append(conn)

    async def _exchange(
        self,
        conn: _Conn | _SockConn,
        raw: bytes,
        res: StreamResult,
        on_event: Callable[[float, bytes], None],
    ) -> bool:
        parser = ResponseParser()
        sse: SSEParser | None = None
        whole: list[bytes] = []
        got_any = False
        try:
            await conn.write(raw)
            res.written = time.monotonic()
            while not parser.done:
                item = await conn.read()
                if item is None:
                    parser.eof()
                    break
                t, data = item
                if not got_any:
                    got_any, res.first_byte = True, t
                res.last_byte = t
                pieces = parser.feed(data)
                if parser.status is not None and sse is None and not whole:
                    res.status, res.headers = parser.status, parser.headers
                    is_sse = parser.headers.get("content-type", "").startswith("text/event-stream")
                    sse = SSEParser() if is_sse and parser.status == 200 else None
                for piece in pieces:
                    if sse is not None:
                        for payload in sse.feed(piece):
                            res.events += 1
                            on_event(t, payload)
                    else:
                        whole.append(piece)
            if whole or (sse is None and parser.done):
                on_event(res.last_byte or time.monotonic(), b"".join(whole))
            res.complete = parser.done
            if not parser.done:
                res.error = "partial: the server closed the connection mid-response"
        except TimeoutError:
            res.error = "timeout"
        except (OSError, ValueError) as e:
            res.error = f"connection: {e}"
        if parser.done and parser.keep_alive and not conn.closed and not conn.reads:
            self._idle.append(conn)
        else:
            conn.close()
        if not got_any and res.error is None and not parser.done:
            res.error = "connection: closed before any response"
        return got_any

    def _close_idle(self) -> None:
        for conn in self._idle:
            with contextlib.suppress(Exception):
                conn.close()
        self._idle.clear()

    async def close(self) -> None:
        await self.cold()
