"""The test server's streams over plain sockets, each request's clock started by the kernel.

The aiohttp test server (``testing/testserver.py``) can start a request's clock no earlier than
its event loop's read of the request's first bytes; with hundreds of streams on one core that
read lags the bytes' arrival by milliseconds, a wait that a client comparing its TTFT with the
server's is charged for. Here every accepted connection is a non-blocking socket with kernel
receive stamps (``SO_TIMESTAMPNS``), read with ``recvmsg`` (``bench/client/kernelstamp.py``): a
request's timeline starts when the kernel received its first bytes. The event loop's read of
them is kept beside it, so that both clocks can be compared on the same requests:
``GET /test/arrivals?ids=a,b`` -> ``{"a": {"kernel": t, "read": t}, ...}`` (monotonic seconds;
no ``kernel`` where the platform gives no stamps). Chunks go straight to the socket
(``sock_sendall``), stamped just before, as the aiohttp server stamps its writes.

It serves the test server's generation (its schedule, fault injection and bookkeeping, from the
same ``TestServer``) over HTTP/1.1 keep-alive: ``POST /v1/completions`` and
``/v1/chat/completions`` (streams as SSE in chunked bodies, whole answers as JSON), ``GET
/v1/timelines``, ``/test/arrivals`` and ``/health``; any other route is a 404. What a client
benchmark needs, not the whole API: requests carry ``Content-Length`` bodies and come one at a
time on a connection.

    python -m servelab.testing.stampserver --port 0 --itl 0.015   # prints READY <port>
    with StampServer(TestServer(Schedule(...))).running() as url: ...
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable
from http.client import responses
from typing import Any
from urllib.parse import parse_qs, urlsplit

import msgspec
from multidict import CIMultiDict

from servelab.bench.client.kernelstamp import recv_stamped, stamp_receives
from servelab.testing.testserver import (
    BACKLOG,
    TestServer,
    error_doc,
    serve_in_thread,
    serve_until_killed,
    server_from_args,
)

_READ_SIZE = 64 * 1024
_GENERATE = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat


class _BadRequest(ValueError):
    pass


class StampServer:
    """Serves ``app`` (its generation and records) over kernel-stamped sockets; see the module
    contract. ``loop`` is the event loop it serves on, once started."""

    def __init__(self, app: TestServer) -> None:
        self.app = app
        self.loop: asyncio.AbstractEventLoop | None = None
        self._connections: set[asyncio.Task[None]] = set()

    def running(
        self, host: str = "127.0.0.1", port: int = 0
    ) -> contextlib.AbstractContextManager[str]:
        """Serve from a background thread; yields the base URL; stops on exit."""
        return serve_in_thread(lambda: self.serve(host, port), host)

    async def serve(self, host: str, port: int) -> tuple[int, Callable[[], Awaitable[None]]]:
        """Listen on ``host:port`` (0: any free port) on the running loop; returns the port
        and the coroutine function that stops serving."""
        loop = self.loop = asyncio.get_running_loop()
        listener = socket.create_server((host, port), backlog=BACKLOG)
        listener.setblocking(False)
        # Accepted sockets inherit it, so a request sent before its connection was accepted is
        # stamped too (a cold wave of 200 connections waits in the accept queue).
        stamp_receives(listener)
        accepting = loop.create_task(self._accept(listener))

        async def stop() -> None:
            tasks = [accepting, *self._connections]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            listener.close()

        return listener.getsockname()[1], stop

    async def _accept(self, listener: socket.socket) -> None:
        assert self.loop is not None
        while True:
            sock, _ = await self.loop.sock_accept(listener)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = self.loop.create_task(self._connection(sock))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _recv(self, sock: socket.socket) -> tuple[bytes, float, float | None]:
        """The next read off ``sock`` (``recv_stamped``'s), made as soon as it is readable."""
        assert self.loop is not None
        with contextlib.suppress(BlockingIOError, InterruptedError):
            return recv_stamped(sock, _READ_SIZE)
        got: asyncio.Future[tuple[bytes, float, float | None]] = self.loop.create_future()

        def readable() -> None:
            if got.done():
                return
            try:
                got.set_result(recv_stamped(sock, _READ_SIZE))
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as e:
                got.set_exception(e)

        fd = sock.fileno()
        self.loop.add_reader(fd, readable)
        try:
            return await got
        finally:
            self.loop.remove_reader(fd)

    async def _connection(self, sock: socket.socket) -> None:
        """Answer the requests of one connection in turn until it closes."""
        buf = b""
        arrivals: dict[str, float] = {}
        try:
            while True:
                while (request := _parse(buf)) is None:
                    data, read, kernel = await self._recv(sock)
                    if not data:
                        return
                    if not buf:  # this read starts the next request
                        arrivals = (
                            {"read": read} if kernel is None else {"kernel": kernel, "read": read}
                        )
                    buf += data
                method, target, headers, body, buf = request
                if not await self._answer(sock, method, target, headers, body, arrivals):
                    return
                if headers.get("Connection", "").lower() == "close":
                    return
        except _BadRequest as e:
            with contextlib.suppress(OSError):
                await self._json(sock, 400, error_doc(400, f"bad request: {e}"))
        except OSError:  # the client went away: nothing to answer
            pass
        finally:
            sock.close()

    async def _answer(
        self,
        sock: socket.socket,
        method: str,
        target: str,
        headers: CIMultiDict[str],
        body: bytes,
        arrivals: dict[str, float],
    ) -> bool:
        """Answer one request; False when the connection is to be closed (a planted cut)."""
        url = urlsplit(target)
        ids = parse_qs(url.query).get("ids", [None])[0]
        if method == "POST" and url.path in _GENERATE:
            return await self._generate(sock, headers, body, _GENERATE[url.path], arrivals)
        doc: Any = None
        if method == "GET" and url.path == "/health":
            await self._send(sock, 200, "text/plain", b"ok")
            return True
        if method == "GET" and url.path == "/v1/timelines":
            doc = self.app.timelines_doc(ids)
        elif method == "GET" and url.path == "/test/arrivals":
            doc = self.app.arrivals_doc(ids)
        if doc is None:
            await self._json(sock, 404, error_doc(404, "Not Found"))
        else:
            await self._json(sock, 200, doc)
        return True

    async def _generate(
        self,
        sock: socket.socket,
        headers: CIMultiDict[str],
        body: bytes,
        chat: bool,
        arrivals: dict[str, float],
    ) -> bool:
        assert self.loop is not None
        try:
            got = self.app.admit(headers, body, chat, arrivals)
        except (msgspec.DecodeError, ValueError, TypeError) as e:
            raise _BadRequest(str(e)) from None
        if isinstance(got, tuple):
            await self._json(sock, got[0], error_doc(*got))
            return True
        if not got.body.get("stream") or got.sched.ignore_stream:
            await self._json(sock, 200, await self.app.full_doc(got), {"X-Request-Id": got.rid})
            return True
        head = {
            "Content-Type": "text/event-stream",
            "X-Request-Id": got.rid,
            "Transfer-Encoding": "chunked",
        }
        await self.loop.sock_sendall(sock, _head(200, head))
        async for data in self.app.stream_writes(got):
            await self.loop.sock_sendall(sock, b"%x\r\n%s\r\n" % (len(data), data))
        if got.timeline.error == "cut":
            return False
        await self.loop.sock_sendall(sock, b"0\r\n\r\n")
        return True

    async def _json(
        self, sock: socket.socket, status: int, doc: Any, headers: dict[str, str] | None = None
    ) -> None:
        await self._send(sock, status, "application/json", msgspec.json.encode(doc), headers)

    async def _send(
        self,
        sock: socket.socket,
        status: int,
        content_type: str,
        body: bytes,
        headers: dict[str, str] | None = None,
    ) -> None:
        assert self.loop is not None
        head = {"Content-Type": content_type, "Content-Length": str(len(body)), **(headers or {})}
        await self.loop.sock_sendall(sock, _head(status, head) + body)


def _parse(buf: bytes) -> tuple[str, str, CIMultiDict[str], bytes, bytes] | None:
    """The first whole request in ``buf`` (method, target, headers, body) and the bytes after
    it; None until it is whole. Raises ``_BadRequest`` on what is not HTTP/1.1."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = buf[:end].decode("latin-1").split("\r\n")
    try:
        method, target, _ = lines[0].split(" ", 2)
    except ValueError:
        raise _BadRequest(f"request line {lines[0]!r}") from None
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon:
            raise _BadRequest(f"header line {line!r}")
        headers.add(name.strip(), value.strip())
    if "chunked" in headers.get("Transfer-Encoding", ""):
        raise _BadRequest("chunked request bodies are not served; send Content-Length")
    try:
        size = int(headers.get("Content-Length", "0"))
    except ValueError:
        raise _BadRequest(f"Content-Length {headers['Content-Length']!r}") from None
    start = end + 4
    if len(buf) < start + size:
        return None
    return method, target, headers, buf[start : start + size], buf[start + size :]


def _head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {responses.get(status, 'Status')}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def main(argv: list[str] | None = None) -> None:
    app, host, port = server_from_args(argv, __doc__.split("\n")[0])
    serve_until_killed(lambda: StampServer(app).serve(host, port))


if __name__ == "__main__":
    main()
