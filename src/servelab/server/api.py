"""The HTTP API (aiohttp): OpenAI routes, health, metrics, timelines.

Contract of the generation routes: a request is validated and tokenised here, then
handed to the engine core; the handler only waits on its own RequestStream. If the
client goes away (aiohttp cancels the handler: ``handler_cancellation=True``), the
``finally`` aborts the request in the core, which frees its KV blocks at once.
Streams send one SSE event per batch of new tokens, the first one carrying the first
token (chat: with ``role``), and end with ``data: [DONE]``. The last event before
[DONE] carries ``"servelab": RequestTimeline.summary()``.

Nothing heavy on the event loop: a body over ``prepare.OFF_LOOP_BYTES`` is decoded,
templated and tokenised in a worker process (prepare.py), and the limits in protocol.py
bound that work, so ``/health`` answers meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from servelab import __version__
from servelab.server import ipc
from servelab.server.engine_client import EngineDeadError, RequestStream
from servelab.server.heap import MALLOC_TRIM
from servelab.server.metrics import CONTENT_TYPE
from servelab.server.openai_errors import APIError, error_body
from servelab.server.openai_protocol import (
    SSE_DONE,
    ModelLimits,
    ParsedRequest,
    ResponseShape,
    finalize,
    sse,
    usage,
)
from servelab.server.prepare import OFF_LOOP_BYTES, TRIM_BYTES, PreparePool, prepare
from servelab.server.serving_client import ServingClient
from servelab.vocab import RequestTimeline

log = logging.getLogger("servelab.server")

_TRIM_DELAY_S = 0.2  # once the request's objects are gone
_LAG_PERIOD_S = 0.05
_RETRY_AFTER_S = "1"
_MAX_ID_LEN = 256


@dataclass
class ServerState:
    """What the handlers share; one per server."""

    client: ServingClient
    tokenizer: Any  # servelab.modelcore.tokenizer.Tokenizer (or a test double with the same API)
    limits: ModelLimits
    prepare_pool: PreparePool  # prepares bodies over OFF_LOOP_BYTES in worker processes
    api_key: str | None = None
    max_queue: int | None = None
    max_body_bytes: int = 16 * 1024**2
    body_timeout_s: float = 30.0
    draining: bool = False

    @property
    def model_name(self) -> str:
        return self.limits.names[0]


STATE = web.AppKey("servelab_state", ServerState)
TRIM_PENDING = web.AppKey("servelab_trim_pending", list)  # [bool]: a malloc_trim is scheduled
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(obj),
        status=status,
        content_type="application/json",
        headers=headers,
    )


# ---- middlewares ----


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves in OpenAI's shape; unexpected ones are logged and answered 500."""
    try:
        return await handler(request)
    except APIError as e:
        request.app[STATE].client.metrics.observe_rejected(e.status)
        resp = _json(e.body(), e.status, e.headers)
        if e.status == 408:  # the rest of a trickling body is not worth waiting for
            resp.force_close()
        return resp
    except web.HTTPException as e:
        if e.status < 400:
            raise
        request.app[STATE].client.metrics.observe_rejected(e.status)
        if e.status == 413:
            limit = request.app[STATE].max_body_bytes
            message = f"The request body exceeds this server's limit of {limit} bytes."
        else:
            message = f"{e.reason}: {request.method} {request.path}"
        return _json(error_body(e.status, message), e.status)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("servelab serve: unexpected error on %s %s", request.method, request.path)
        return _json(error_body(500, "Internal server error; see the server log."), 500)


@web.middleware
async def _return_memory(request: web.Request, handler: Handler) -> web.StreamResponse:
    """glibc keeps the heap a big body grew: after its first big free it raises its mmap
    threshold, so later big buffers come from the heap and stay there once freed (ten
    refused 15 MB prompts left the API process at +82% RSS). A moment after such a request
    ends, ``malloc_trim`` in a thread hands the free pages back; one trim covers a burst."""
    try:
        return await handler(request)
    finally:
        app = request.app
        if MALLOC_TRIM is not None and (request.content_length or 0) >= TRIM_BYTES:
            if not app[TRIM_PENDING][0]:
                app[TRIM_PENDING][0] = True
                loop = asyncio.get_running_loop()
                loop.call_later(_TRIM_DELAY_S, _trim_soon, app, loop)


def _trim_soon(app: web.Application, loop: asyncio.AbstractEventLoop) -> None:
    app[TRIM_PENDING][0] = False
    assert MALLOC_TRIM is not None
    loop.run_in_executor(None, MALLOC_TRIM, 0)  # ctypes releases the GIL


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With an API key set, /v1 routes (as in vLLM) and every other state-changing route
    (any method but GET/HEAD, e.g. /reset_prefix_cache) need ``Authorization: Bearer KEY``.
    /health, /metrics and /version stay open for probes and scrapers, as in vLLM."""
    key = request.app[STATE].api_key
    if key is not None and (
        request.path.startswith("/v1/") or request.method not in ("GET", "HEAD")
    ):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise APIError(
                401,
                "Missing or wrong API key: send it as 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
            )
    return await handler(request)


# ---- generation ----


def _request_id(request: web.Request, st: ServerState) -> str:
    """The client's X-Request-Id, made unique among live and remembered requests."""
    base = request.headers.get("X-Request-Id", "").strip()[:_MAX_ID_LEN]
    if not base:
        return uuid.uuid4().hex
    rid, k = base, 0
    while st.client.has_request(rid) or rid in st.client.timelines:
        k += 1
        rid = f"{base}-{k}"
    return rid


async def _read_body(request: web.Request, st: ServerState) -> bytes:
    """The whole body, or 408 if it trickles in slower than --body-timeout allows."""
    try:
        return await asyncio.wait_for(request.read(), st.body_timeout_s)
    except asyncio.TimeoutError:
        raise APIError(
            408,
            f"The request body did not arrive within {st.body_timeout_s:g} s of its headers "
            "(the server's --body-timeout); the connection is closed.",
        ) from None


async def _prompt_ids(request: web.Request, body: bytes, chat: bool) -> ParsedRequest:
    st = request.app[STATE]
    if len(body) <= OFF_LOOP_BYTES:
        return prepare(st.tokenizer, st.limits, body, chat)
    return await st.prepare_pool.prepare(st.limits, body, chat)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    arrival = time.monotonic()  # the engine timeline starts here: API work counts as queueing
    st = request.app[STATE]
    if st.draining:
        raise APIError(503, "The server is shutting down; retry on another instance.")
    if not st.client.alive:
        raise APIError(
            503,
            f"{st.client.dead_reason or 'The engine is not running'}; restart the server.",
            code="engine_dead",
        )
    parsed = await _prompt_ids(request, await _read_body(request, st), chat)
    assert parsed.token_ids is not None
    params = finalize(parsed, parsed.token_ids, st.limits)
    if st.max_queue is not None and st.client.num_waiting >= st.max_queue:
        raise APIError(
            429,
            f"The server's queue is full ({st.max_queue} waiting requests); retry after a second.",
            code="queue_full",
            headers={"Retry-After": _RETRY_AFTER_S},
        )
    rid = _request_id(request, st)
    try:
        stream = st.client.submit(
            ipc.AddRequest(
                rid, parsed.token_ids, dataclasses.asdict(params), parsed.priority, arrival
            )
        )
    except EngineDeadError as e:
        raise APIError(503, f"{e}; restart the server.", code="engine_dead") from None
    shape = ResponseShape(chat, rid, st.model_name, int(time.time()))
    try:
        if parsed.stream:
            return await _stream(request, stream, shape, parsed.include_usage)
        return await _collect(stream, shape)
    finally:
        if not stream.finished:
            st.client.abort(rid)


def _summary(out: ipc.Output) -> dict[str, Any] | None:
    if not out.timeline:
        return None
    summary = RequestTimeline.from_dict(out.timeline).summary()
    transfer = out.timeline.get("kv_transfer")  # disaggregated serving: the KV hand-off
    if transfer:
        summary["kv_transfer"] = {
            k: transfer[k]
            for k in ("seconds", "handoff_wait", "bytes", "blocks", "skipped_blocks")
            if k in transfer
        }
    return summary


async def _stream(
    request: web.Request, stream: RequestStream, shape: ResponseShape, include_usage: bool
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Request-Id": shape.request_id,
        }
    )
    first = True
    n_prompt = n_out = 0
    try:
        await resp.prepare(request)  # the client may already have gone: no 500 in the log
        while True:
            outs = await stream.get()
            last = outs[-1]
            n_prompt = last.num_prompt_tokens or n_prompt
            n_out = last.num_output_tokens or n_out
            if last.finish_reason == "error":
                if any(o.new_token_ids for o in outs):  # tokens that came just before it
                    text = "".join(o.new_text for o in outs)
                    await resp.write(sse(shape.chunk(text, None, first)))
                await resp.write(
                    sse(APIError(last.error_status, last.error or "engine error").body())
                )
                await resp.write(SSE_DONE)
                break
            if not last.finished and not any(o.new_token_ids for o in outs):
                continue  # nothing to send yet: the first event must carry a token
            chunk = shape.chunk("".join(o.new_text for o in outs), last.finish_reason, first)
            first = False
            if not last.finished:
                await resp.write(sse(chunk))
                continue
            summary = _summary(last)
            if include_usage:
                await resp.write(sse(chunk))
                chunk = shape.usage_chunk(usage(n_prompt, n_out))
            if summary is not None:
                chunk["servelab"] = summary
            await resp.write(sse(chunk))
            await resp.write(SSE_DONE)
            break
    except EngineDeadError as e:
        await _write_quietly(
            resp, sse(error_body(503, f"{e}; the request could not finish.", code="engine_dead"))
        )
        await _write_quietly(resp, SSE_DONE)
    except ConnectionResetError:
        pass  # the client went away; the caller aborts the request
    return resp


async def _write_quietly(resp: web.StreamResponse, data: bytes) -> None:
    with contextlib.suppress(ConnectionResetError):
        await resp.write(data)


async def _collect(stream: RequestStream, shape: ResponseShape) -> web.Response:
    texts: list[str] = []
    n_prompt = n_out = 0
    while True:
        try:
            outs = await stream.get()
        except EngineDeadError as e:
            raise APIError(503, f"{e}; the request could not finish.", code="engine_dead") from None
        texts.extend(o.new_text for o in outs)
        last = outs[-1]
        n_prompt = last.num_prompt_tokens or n_prompt
        n_out = last.num_output_tokens or n_out
        if last.finished:
            break
    if last.finish_reason == "error":
        raise APIError(last.error_status, last.error or "The engine failed the request.")
    body = shape.full("".join(texts), last.finish_reason, usage(n_prompt, n_out))
    summary = _summary(last)
    if summary is not None:
        body["servelab"] = summary
    return _json(body, headers={"X-Request-Id": shape.request_id})


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


# ---- everything else ----


async def models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    card = {
        "id": st.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "servelab",
        "root": st.client.info.model if st.client.info else st.model_name,
        "max_model_len": st.limits.max_model_len,
    }
    return _json({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    """200 while the server can serve. A disaggregated server also lists its workers
    (``status`` "degraded" when some died but a prefill and a decode worker remain)."""
    st = request.app[STATE]
    if st.draining:
        raise APIError(503, "The server is shutting down.")
    report = getattr(st.client, "health_report", None)
    if report is not None:
        ok, body = report()
        if ok:
            return _json(body)
        error = error_body(
            503, st.client.dead_reason or "No worker is running.", code="engine_dead"
        )
        return _json({**error, **body}, 503)
    if not st.client.alive:
        raise APIError(
            503, st.client.dead_reason or "The engine core is not running.", code="engine_dead"
        )
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    """servelab's version and the engine's resolved configuration (for run manifests)."""
    client = request.app[STATE].client
    engine = msgspec.to_builtins(client.info) if client.info is not None else None
    if engine is not None:
        engine.pop("pid", None)  # /version is open without the API key: no process ids
    body: dict[str, Any] = {"version": __version__, "engine": engine}
    workers = getattr(client, "workers_info", None)
    if workers is not None:  # disaggregated: each worker's role, pid, threads and CPUs
        body["workers"] = workers()
    return _json(body)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].client.metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def timelines(request: web.Request) -> web.Response:
    """Recent finished timelines and step records: ``?ids=a,b`` and ``?since_step=N`` filter."""
    st = request.app[STATE]
    ids_arg = request.query.get("ids")
    ids = [i for i in ids_arg.split(",") if i] if ids_arg is not None else None
    since_arg = request.query.get("since_step")
    try:
        since = int(since_arg) if since_arg is not None else None
    except ValueError:
        raise APIError(
            400, f"since_step must be an integer step id, got {since_arg!r}.", param="since_step"
        ) from None
    return _json(st.client.timelines.query(ids, since))


async def reset_prefix_cache(request: web.Request) -> web.Response:
    st = request.app[STATE]
    try:
        reset = await st.client.call("reset_prefix_cache")
    except EngineDeadError as e:
        raise APIError(503, str(e), code="engine_dead") from None
    return _json({"reset": bool(reset)})


# ---- app ----


async def _watch_loop_lag(app: web.Application) -> Any:
    """Measure how late a periodic timer fires: the API event loop's responsiveness."""
    hist = app[STATE].client.metrics.loop_lag
    loop = asyncio.get_running_loop()

    async def watch() -> None:
        while True:
            t0 = loop.time()
            await asyncio.sleep(_LAG_PERIOD_S)
            hist.observe(max(0.0, loop.time() - t0 - _LAG_PERIOD_S))

    task = asyncio.create_task(watch(), name="servelab-loop-lag")
    yield
    task.cancel()


def build_app(state: ServerState) -> web.Application:
    app = web.Application(
        middlewares=[_return_memory, _errors, _auth], client_max_size=state.max_body_bytes
    )
    app[TRIM_PENDING] = [False]
    app[STATE] = state
    app.cleanup_ctx.append(_watch_loop_lag)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/timelines", timelines)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    return app


# ---- aiohttp's own errors ----

_CAMEL_RE = re.compile(r"(?<!^)(?=[A-Z])")


class _Handler(web.RequestHandler):
    """One connection, with two changes to aiohttp's.

    - **Its own error answers** (HTTP its parser refuses: oversized or too many headers, a
      bad method, Content-Length with Transfer-Encoding, a bad chunk size...) in OpenAI's
      shape, with the parser's exception as the code (``LineTooLong`` -> ``line_too_long``).
    - **A head timer apart from the idle one.** aiohttp has one timer, ``keepalive_timeout``,
      for both a slow request head and an idle connection. A short one bounds slowloris but
      closes idle connections before clients' pools drop them (aiohttp's keeps them 15 s),
      and a client that reuses one just as it closes gets a reset: a POST is not retried
      (aiohttp issues 2682 and 9138). So
      aiohttp's timer closes idle connections (``--keep-alive-timeout``), and a request
      head must arrive whole within ``head_timeout`` (``--header-timeout``) of the
      connection's opening or of its first byte after the previous request. Only a head's
      bytes start that timer, never a body's (nor aiohttp's own empty re-feeds): body
      bytes that came just after the head, before aiohttp's handler task started, once
      armed it and cut that request's stream ``head_timeout`` seconds later, with nothing
      in the log.
    """

    __slots__ = ("head_timeout", "_head_handle", "_in_body")

    def __init__(self, *args: Any, head_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_timeout = head_timeout
        self._head_handle: asyncio.TimerHandle | None = None
        self._in_body = False  # the last head's body has not all arrived

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm_head()

    def data_received(self, data: bytes) -> None:
        heads = self._request_count
        if (
            data  # aiohttp calls this with b"" itself, to reparse what it buffered
            and self._head_handle is None
            and not self._in_body
            and not self._request_in_progress
            and not self._messages
        ):
            self._arm_head()  # the first byte of a new head
        super().data_received(data)
        if self._request_count != heads:
            if self._head_handle is not None:
                self._head_handle.cancel()  # the head is whole
                self._head_handle = None
            # Until the newest head's body is whole, what comes is that body, even while
            # neither a handler runs nor a request waits (aiohttp starts the handler task
            # a loop iteration after it takes the request). Earlier heads' bodies are
            # whole: the parser reads a head only after the previous body.
            self._in_body = True
            self._messages[-1][1].on_eof(self._body_done)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_handle is not None:
            self._head_handle.cancel()
            self._head_handle = None
        super().connection_lost(exc)

    def _body_done(self) -> None:
        self._in_body = False

    def _arm_head(self) -> None:
        self._head_handle = self._loop.call_later(
            self.head_timeout, self._head_expired, self._request_count
        )

    def _head_expired(self, heads: int) -> None:
        self._head_handle = None
        if self._request_count == heads:  # no whole head came in time
            self.force_close()

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # too late for an error response: aiohttp raises
            return super().handle_error(request, status, exc, message)
        if status >= 500:
            log.error("servelab serve: error handling a request", exc_info=exc)
            body = error_body(status, "Internal server error; see the server log.")
        else:
            # Debug only: a client can send malformed HTTP at will, and must not fill the log.
            log.debug("servelab serve: refused malformed HTTP from %s: %s", request.remote, exc)
            code = _CAMEL_RE.sub("_", type(exc).__name__).lower() if exc is not None else None
            text = message or (str(exc) if exc is not None else "the server cannot parse it")
            body = error_body(status, f"Malformed HTTP request: {text}", code=code)
        resp = _json(body, status)
        resp.force_close()
        return resp


class _Server(web.Server):
    head_timeout: float

    def __call__(self) -> web.RequestHandler:
        return _Handler(self, loop=self._loop, head_timeout=self.head_timeout, **self._kwargs)


class ApiAppRunner(web.AppRunner):
    """web.AppRunner whose connections answer aiohttp's own errors as JSON and bound a
    request head with ``head_timeout`` seconds (see ``_Handler``); ``keepalive_timeout``
    closes idle connections.

    aiohttp has no public hook for this: the server it builds is given our handler class.
    tests/test_server_hardening.py pins the behaviour, so an aiohttp upgrade that changes
    these internals fails a test rather than silently going back to aiohttp's."""

    def __init__(self, app: web.Application, *, head_timeout: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._head_timeout = head_timeout

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server
        assert isinstance(server, _Server)
        server.head_timeout = self._head_timeout
        return server
