"""A deterministic OpenAI-compatible SSE server that streams tokens on a known schedule.

It exists to check benchmark clients: the first token goes ``ttft`` seconds after the
request arrives, then one chunk every ``itl`` seconds (plus a ``stall`` every
``stall_every`` chunks), each carrying ``tokens_per_chunk`` tokens. The server
records when it wrote every chunk (``time.monotonic()``, system-wide on Linux), and
serves those times as servelab timelines (``GET /v1/timelines?ids=...``), so a test
or benchmark can compare what the client measured with what really happened.

Reasoning models (chat): the first ``reasoning`` tokens stream as ``reasoning_content``.
Fault injection for tests: a role-only first chunk (chat), empty chunks between
token chunks, several SSE events coalesced into one write, a connection cut after
``fail_after`` tokens, an HTTP error ``status``; and servers that miscount: a stream of
no token at all (``no_tokens``), a whole JSON answer to a stream request
(``ignore_stream``), a ``usage`` that claims ``usage_factor`` times the tokens it streamed.
Per request, the JSON header ``X-Test-Schedule`` overrides any of these fields.
``POST /tokenize`` answers in vLLM's and SGLang's dialect (``{"prompt"}`` ->
``{"tokens", "count"}``) and llama.cpp's (``{"content"}`` -> ``{"tokens"}``), one token
per whitespace-led word (the count its timelines give a prompt); ``/detokenize`` inverts it.
With ``steps`` (the fields of ``bench.teststeps.StepPlan``) streams are not timed one by
one: one loop of engine steps of planted cost serves them all, and ``GET /test/steps``
returns the steps it ran.

A request's clock starts when the event loop reads its first bytes off the socket (before the
handler is dispatched); ``GET /test/arrivals?ids=...`` gives that read stamp per request
(``{"read": t}``). ``testing/stampserver.py`` serves the same generation over sockets the
kernel stamps, and starts the clock at the kernel's receipt instead (``kernel_stamps=True``
below).

In-process: ``with TestServer(Schedule(...)).running() as url: ...`` (a background
thread). Out of process (to pin it to a CPU): ``with run_test_server(schedule,
cpu=1) as url: ...`` or ``python -m servelab.testing.testserver --port 0 --itl 0.015``
(prints ``READY <port>`` when it is listening).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web, web_protocol

from servelab.bench.client.event_loop import run_loop
from servelab.testing.teststeps import StepLoop, StepPlan
from servelab.vocab import FinishReason, RequestTimeline

WORDS = (" the", " of", " and", " to", " in", " a", " is", " that")
# Pending connections the kernel queues before accept. aiohttp's default, 128, is below the
# stream counts the client benchmarks open at once: the kernel drops the SYNs past it and the
# client retries after 1 s, a delay the server's timelines never see (TTFT "errors" of ~1 s).
BACKLOG = 4096


class _ReadStamped(web_protocol.RequestHandler):
    """aiohttp's connection handler, stamping when a request's first bytes are read off its
    socket: the arrival a server's own clock means. A handler's clock starts only after the
    loop has read and dispatched every request that arrived with it (up to 200 at once in the
    client benchmarks), a queue no client can see. Requests on one connection come one at a
    time (no pipelining), so the first read since the last request was taken is this one's."""

    received_at: float | None = None
    arrival: float | None = None  # the request being handled: its first read (_take_arrival)

    def data_received(self, data: bytes) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()
        super().data_received(data)


@web.middleware
async def _take_arrival(request: web.Request, handler: Any) -> web.StreamResponse:
    """Moves the connection's read stamp to ``arrival``, this request's (one request at a time
    on a connection, so the protocol can hold it)."""
    proto = request.protocol
    if isinstance(proto, _ReadStamped):
        proto.arrival, proto.received_at = proto.received_at, None
    return await handler(request)


class _StampedServer(web.Server):
    def __call__(self) -> web.RequestHandler:
        return _ReadStamped(self, loop=self._loop, **self._kwargs)


class _StampedRunner(web.AppRunner):
    """web.AppRunner whose connections are ``_ReadStamped``: aiohttp has no public hook for a
    handler class, so the server it builds is given ours (as ``server.api.ApiAppRunner``)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _StampedServer
        return server


@dataclass
class Schedule:
    """How the server answers one request (all times in seconds)."""

    ttft: float = 0.05
    itl: float = 0.01
    stall_every: int = 0  # a stall before every n-th chunk (0: none)
    stall: float = 0.0
    tokens_per_chunk: int = 1
    role_chunk: bool = True  # chat: send {"role": "assistant"} at once, with no content
    empty_chunk_every: int = 0  # also send a content-less chunk after every n-th token chunk
    coalesce: int = 1  # SSE events per socket write
    fail_after: int | None = None  # cut the connection after this many tokens
    status: int = 200  # != 200: answer with an OpenAI error body
    default_max_tokens: int = 16
    reasoning: int = 0  # chat: the first n tokens stream as delta.reasoning_content
    queue: float = 0.0  # of ``ttft``, the seconds reported as queueing (admitted after it)
    # Which per-request figures the final chunk/response carries: "servelab" (a phase
    # summary), "vllm" (vLLM's ``metrics``), "llamacpp" (``timings``), "malformed" (a
    # ``metrics`` object with a non-numeric field) or "none".
    report: str = "servelab"
    metrics: str = "ok"  # /metrics: "ok", "missing" (404), "malformed" or "slow" (2 s late)
    no_tokens: bool = False  # stream: a 200 with usage and [DONE] but no token chunk
    ignore_stream: bool = False  # answer a stream request with a whole application/json body
    usage_factor: float = 1.0  # usage claims this many times the completion tokens sent
    tokenize: bool = True  # serve POST /tokenize and /detokenize
    after_done: int = 0  # stream: token chunks sent after data: [DONE], one ITL apart (a misstep)
    steps: dict[str, Any] | None = None  # planted engine steps (bench.teststeps.StepPlan)

    def chunk_offsets(self, n_chunks: int) -> list[float]:
        """When each token chunk is due, in seconds after the request arrived."""
        out, t = [], self.ttft
        for j in range(n_chunks):
            if j > 0:
                t += self.itl
                if self.stall_every and j % self.stall_every == 0:
                    t += self.stall
            out.append(t)
        return out


@dataclass
class _Served:
    timeline: RequestTimeline
    body: dict[str, Any]
    headers: dict[str, str]
    arrivals: dict[str, float]  # TestServer.admit's


@dataclass
class Admitted:
    """A generation request ``TestServer.admit`` took: what to answer it with."""

    rid: str
    body: dict[str, Any]
    n: int  # output tokens
    sched: Schedule
    chat: bool
    timeline: RequestTimeline


@dataclass
class TestServer:
    """The server's state; ``app()`` builds the aiohttp application."""

    __test__ = False  # not a pytest test class

    schedule: Schedule = field(default_factory=Schedule)
    model: str = "test-model"
    max_model_len: int = 8192
    api_key: str | None = None
    served: dict[str, _Served] = field(default_factory=dict)
    resets: int = 0
    metrics_scrapes: int = 0
    _counter: int = 0
    _vocab: _WordVocab = field(default_factory=lambda: _WordVocab())
    _step_loop: StepLoop | None = None

    # ------------------------------------------------------------------ routes

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_take_arrival])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/timelines", self._timelines)
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/reset_prefix_cache", self._reset)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/test/requests", self._requests)
        app.router.add_get("/test/steps", self._steps)
        app.router.add_get("/test/arrivals", self._arrivals)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "testserver"})

    async def _models(self, request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "max_model_len": self.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_scrapes += 1
        mode = self.schedule.metrics
        if mode == "missing":
            return web.Response(status=404, text="404: Not Found")
        if mode == "malformed":
            return web.Response(text="vllm:num_requests_running {{{ not prometheus\n")
        if mode == "slow":
            await asyncio.sleep(2.0)
        now = time.monotonic()
        tls = [v.timeline for v in self.served.values()]
        waiting = sum(1 for t in tls if t.finished is None and t.scheduled[0] > now)
        running = sum(1 for t in tls if t.finished is None and t.scheduled[0] <= now)
        prompt = sum(t.prompt_tokens for t in tls)
        text = (
            "# TYPE vllm:request_success_total counter\n"
            f"vllm:request_success_total {sum(t.finished is not None for t in tls)}\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running {running}\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting {waiting}\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc {min(1.0, running / 16)}\n"
            "# TYPE vllm:prefix_cache_queries counter\n"
            f"vllm:prefix_cache_queries_total {prompt}\n"
            "# TYPE vllm:prefix_cache_hits counter\n"
            f"vllm:prefix_cache_hits_total {prompt // 4}\n"
            "# TYPE vllm:cache_config_info gauge\n"
            'vllm:cache_config_info{block_size="16",enable_prefix_caching="True"} 1.0\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def _reset(self, request: web.Request) -> web.Response:
        self.resets += 1
        return web.json_response({"reset": True})

    async def _tokenize(self, request: web.Request) -> web.Response:
        if not self.schedule.tokenize:
            return _error(404, "Not Found")
        body = msgspec.json.decode(await request.read())
        if "content" in body:  # llama.cpp
            return web.json_response({"tokens": self._vocab.encode(str(body["content"]))})
        if "prompt" not in body:
            return _error(400, "give 'prompt' (or llama.cpp's 'content')")
        ids = self._vocab.encode(str(body["prompt"]))
        return web.json_response(
            {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}
        )

    async def _detokenize(self, request: web.Request) -> web.Response:
        if not self.schedule.tokenize:
            return _error(404, "Not Found")
        body = msgspec.json.decode(await request.read())
        text = self._vocab.decode(list(body.get("tokens", [])))
        return web.json_response({"prompt": text, "content": text})

    async def _timelines(self, request: web.Request) -> web.Response:
        doc = self.timelines_doc(request.query.get("ids"))
        if doc is None:
            return web.Response(status=404, text="404: Not Found")
        return web.json_response(doc)

    def timelines_doc(self, ids: str | None) -> dict[str, Any] | None:
        """``GET /v1/timelines``'s answer for the comma-separated ``ids`` (None: all); None
        when the schedule emulates another server, which has none."""
        if self.schedule.report != "servelab":
            return None
        keys = ids.split(",") if ids else list(self.served)
        tls = [self.served[k].timeline.to_dict() for k in keys if k in self.served]
        return {"timelines": tls, "steps": []}

    async def _arrivals(self, request: web.Request) -> web.Response:
        return web.json_response(self.arrivals_doc(request.query.get("ids")))

    def arrivals_doc(self, ids: str | None) -> dict[str, dict[str, float]]:
        """``GET /test/arrivals``: each request's arrival stamps (``admit``'s), by id."""
        keys = ids.split(",") if ids else list(self.served)
        return {k: self.served[k].arrivals for k in keys if k in self.served}

    async def _requests(self, request: web.Request) -> web.Response:
        return web.json_response(
            [{"id": k, "body": v.body, "headers": v.headers} for k, v in self.served.items()]
        )

    async def _steps(self, request: web.Request) -> web.Response:
        return web.json_response(self._step_loop.steps if self._step_loop else [])

    def _planted(self, rid: str, prompt: int, chunks: int, sched: Schedule) -> Any:
        """The queue of ``rid``'s token times from the planted step loop (None: unplanted)."""
        if not sched.steps:
            return None
        if self._step_loop is None:
            self._step_loop = StepLoop(StepPlan(**sched.steps))
        return self._step_loop.join(rid, prompt, chunks)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    # ------------------------------------------------------------------ generation

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        read = getattr(request.protocol, "arrival", None) or time.monotonic()
        raw = await request.read()
        if isinstance(request.protocol, _ReadStamped):
            # A body read in a later segment stamped again: the next bytes are the next request.
            request.protocol.received_at = None
        got = self.admit(request.headers, raw, chat, {"read": read})
        if isinstance(got, tuple):
            return _error(*got)
        if not got.body.get("stream") or got.sched.ignore_stream:
            return web.json_response(await self.full_doc(got), headers={"X-Request-Id": got.rid})
        return await self._stream(request, got)

    def admit(
        self, headers: Mapping[str, str], raw: bytes, chat: bool, arrivals: dict[str, float]
    ) -> Admitted | tuple[int, str]:
        """Check a generation request and record it, or say the status and message to answer
        instead. ``arrivals`` (monotonic seconds): ``"read"``, when the server's event loop
        read the request's first bytes, and ``"kernel"`` where known, when the kernel received
        them; the timeline's arrival is the kernel's, else the read's."""
        if self.api_key is not None and headers.get("Authorization") != f"Bearer {self.api_key}":
            return 401, "Missing or wrong API key."
        body = msgspec.json.decode(raw)
        sched = self.schedule
        override = headers.get("X-Test-Schedule")
        if override:
            sched = dataclasses.replace(sched, **json.loads(override))
        if sched.status != 200:
            return sched.status, f"planted error {sched.status}"
        self._counter += 1
        rid = headers.get("X-Request-Id") or f"test-{self._counter}"
        # Chat clients may send OpenAI's newer name for the same limit.
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        n = int(limit or sched.default_max_tokens)
        prompt = _prompt_text(body, chat)
        arrival = arrivals.get("kernel", arrivals["read"])
        tl = RequestTimeline(rid, arrival, prompt_tokens=len(prompt.split()), queued=[arrival])
        tl.scheduled.append(arrival + min(sched.queue, sched.ttft))
        kept = {k: v for k, v in headers.items() if k.lower() != "authorization"}
        kept["has_authorization"] = str("Authorization" in headers)
        self.served[rid] = _Served(tl, body, kept, dict(arrivals))
        return Admitted(rid, body, n, sched, chat, tl)

    async def full_doc(self, req: Admitted) -> dict[str, Any]:
        """The whole (non-stream) answer to ``req``, once its last token is due."""
        tl, n, sched = req.timeline, req.n, req.sched
        offsets = sched.chunk_offsets(math.ceil(n / sched.tokens_per_chunk))
        await _sleep_until(tl.arrival + offsets[-1])
        now = time.monotonic()
        tl.first_token, tl.token_times, tl.finished = now, [now] * n, now
        tl.output_tokens, tl.finish_reason = n, FinishReason.LENGTH
        text = "".join(WORDS[i % len(WORDS)] for i in range(n))
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if req.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        usage = _usage(tl.prompt_tokens, round(n * sched.usage_factor))
        return {"id": req.rid, "choices": [choice], "usage": usage, **_figures(tl, sched.report)}

    async def _stream(self, request: web.Request, req: Admitted) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "X-Request-Id": req.rid}
        )
        try:
            await resp.prepare(request)
            async for data in self.stream_writes(req):
                await resp.write(data)
            if req.timeline.error == "cut":
                assert request.transport is not None
                request.transport.close()
                return resp
            await resp.write_eof()
        except ConnectionResetError:  # the client went away (a timeout test): nothing to do
            return web.Response(status=499)
        return resp

    async def stream_writes(self, req: Admitted) -> AsyncIterator[bytes]:
        """The SSE body of ``req``'s stream, one socket write at a time, each yielded when it
        is due and stamped in the timeline just before (the caller writes it at once). After a
        planted cut (``fail_after``) it stops with the timeline's error ``"cut"``: the caller
        closes the connection instead of ending the body."""
        rid, body, n, sched, tl = req.rid, req.body, req.n, req.sched, req.timeline
        chat = req.chat
        opts = body.get("stream_options") or {}
        continuous = bool(opts.get("continuous_usage_stats"))
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(
            text: str | None,
            finish: str | None = None,
            usage: dict | None = None,
            role: bool = False,
            reasoning: bool = False,
        ) -> bytes:
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["reasoning_content" if reasoning else "content"] = text
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
            d: dict[str, Any] = {"id": rid, "object": obj, "choices": [choice]}
            if usage is not None:
                d["usage"] = usage
            return b"data: " + msgspec.json.encode(d) + b"\n\n"

        if chat and sched.role_chunk:
            yield event(None, role=True)
        k = sched.tokens_per_chunk
        n_chunks = 0 if sched.no_tokens else math.ceil(n / k)
        offsets = sched.chunk_offsets(n_chunks)
        planted = self._planted(rid, tl.prompt_tokens, n_chunks, sched)
        pending: list[bytes] = []
        sent = batched = 0
        for j, off in enumerate(offsets):
            m = min(k, n - sent)
            text = "".join(WORDS[(sent + i) % len(WORDS)] for i in range(m))
            thinking = sent < sched.reasoning
            sent += m
            claimed = round(sent * sched.usage_factor)
            usage = _usage(tl.prompt_tokens, claimed) if continuous else None
            pending.append(event(text, "length" if sent == n else None, usage, reasoning=thinking))
            if sched.empty_chunk_every and (j + 1) % sched.empty_chunk_every == 0 and sent < n:
                pending.append(event(""))
            batched += 1
            if batched < sched.coalesce and sent < n:
                continue
            batched = 0
            if planted is None:
                await _sleep_until(tl.arrival + off)
            else:
                await planted.get()
            if sched.fail_after is not None and sent > sched.fail_after:
                tl.finished, tl.finish_reason, tl.error = (
                    time.monotonic(),
                    FinishReason.ABORT,
                    "cut",
                )
                return
            now = time.monotonic()
            if tl.first_token is None:
                tl.first_token = now
            tl.token_times.extend([now] * (sent - len(tl.token_times)))
            yield b"".join(pending)
            pending = []
        tl.finished, tl.output_tokens, tl.finish_reason = (
            time.monotonic(),
            sent,
            FinishReason.LENGTH,
        )
        if opts.get("include_usage"):
            final = {
                "id": rid,
                "object": obj,
                "choices": [],
                "usage": _usage(tl.prompt_tokens, round(sent * sched.usage_factor)),
                **_figures(tl, sched.report),
            }
            yield b"data: " + msgspec.json.encode(final) + b"\n\n"
        yield b"data: [DONE]\n\n"
        for _ in range(sched.after_done):
            await asyncio.sleep(sched.itl)
            yield event(WORDS[0], None, _usage(tl.prompt_tokens, sent + 1))

    # ------------------------------------------------------------------ running

    async def serve(self, host: str, port: int) -> tuple[int, Callable[[], Awaitable[None]]]:
        """Listen on ``host:port`` (0: any free port) on the running loop; returns the port
        and the coroutine function that stops serving."""
        runner = _StampedRunner(self.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port, backlog=BACKLOG).start()
        return runner.addresses[0][1], runner.cleanup

    def running(
        self, host: str = "127.0.0.1", port: int = 0
    ) -> contextlib.AbstractContextManager[str]:
        """Serve from a background thread; yields the base URL; stops on exit."""
        return serve_in_thread(lambda: self.serve(host, port), host)


Serve = Callable[[], Awaitable[tuple[int, Callable[[], Awaitable[None]]]]]


@contextlib.contextmanager
def serve_in_thread(serve: Serve, host: str) -> Iterator[str]:
    """Run a server on an event loop of its own in a background thread: ``serve`` (a server's
    ``serve`` bound to its address) starts it; yields the base URL; stops it on exit."""
    ready = threading.Event()
    box: dict[str, Any] = {}

    def main() -> None:
        loop = asyncio.new_event_loop()
        box["loop"] = loop
        box["port"], stop = loop.run_until_complete(serve())
        ready.set()
        loop.run_until_complete(box.setdefault("stop", loop.create_future()))
        loop.run_until_complete(stop())
        loop.close()

    thread = threading.Thread(target=main, name="testserver", daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("the test server did not start within 10 s")
    try:
        yield f"http://{host}:{box['port']}"
    finally:
        loop = box["loop"]
        loop.call_soon_threadsafe(lambda: box["stop"].done() or box["stop"].set_result(None))
        thread.join(10)


class _WordVocab:
    """``/tokenize``'s tokens: each whitespace-led word (``" river"``) is one id, given in
    order of first sight; trailing whitespace is a token of its own."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text: str) -> list[int]:
        out = []
        for w in re.findall(r"\s*\S+|\s+$", text):
            i = self.ids.get(w)
            if i is None:
                i = self.ids[w] = len(self.words)
                self.words.append(w)
            out.append(i)
        return out

    def decode(self, ids: list[int]) -> str:
        return "".join(self.words[i] for i in ids if 0 <= i < len(self.words))


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _figures(tl: RequestTimeline, report: str) -> dict[str, Any]:
    """The per-request figures of the final chunk, in the dialect ``report`` names."""
    if report == "servelab":
        return {"servelab": tl.summary()}
    ms = {"queue": tl.queue_time * 1e3, "prefill": tl.prefill_time * 1e3}
    decode = tl.decode_time * 1e3
    if report == "vllm":
        itl = decode / max(1, tl.output_tokens - 1)
        metrics = {
            "queue_time_ms": ms["queue"],
            "time_to_first_token_ms": ms["prefill"],
            "generation_time_ms": decode,
            "mean_itl_ms": itl,
            "tokens_per_second": tl.output_tokens / decode * 1e3 if decode > 0 else 0.0,
            "speculative_decoding": None,
        }
        return {"metrics": metrics}
    if report == "llamacpp":
        timings = {
            "prompt_n": tl.prompt_tokens,
            "cache_n": 0,
            "prompt_ms": ms["prefill"],
            "predicted_n": tl.output_tokens,
            "predicted_ms": decode,
        }
        return {"timings": timings}
    if report == "malformed":
        return {"metrics": {"queue_time_ms": "soon", "time_to_first_token_ms": ms["prefill"]}}
    return {}


def _prompt_text(body: dict[str, Any], chat: bool) -> str:
    if chat:
        return " ".join(str(m.get("content", "")) for m in body.get("messages", []))
    p = body.get("prompt", "")
    return p if isinstance(p, str) else " ".join(map(str, p))


def error_doc(status: int, message: str) -> dict[str, Any]:
    """An OpenAI error body."""
    return {"error": {"message": message, "type": "test_error", "param": None, "code": status}}


def _error(status: int, message: str) -> web.Response:
    return web.json_response(error_doc(status, message), status=status)


async def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


@contextlib.contextmanager
def run_test_server(
    schedule: Schedule | None = None,
    cpu: int | None = None,
    api_key: str | None = None,
    kernel_stamps: bool = False,
) -> Iterator[str]:
    """Run the test server in a child process (pinned to ``cpu`` with taskset if given); with
    ``kernel_stamps``, its streams over stamped sockets (``testing/stampserver.py``)."""
    sched = schedule or Schedule()
    module = "servelab.testing.stampserver" if kernel_stamps else "servelab.testing.testserver"
    cmd = [
        sys.executable,
        "-m",
        module,
        "--port",
        "0",
        "--schedule",
        json.dumps(dataclasses.asdict(sched)),
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    if cpu is not None and shutil.which("taskset"):
        cmd = ["taskset", "-c", str(cpu), *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("READY "):
            raise RuntimeError(f"the test server failed to start (said {line!r})")
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def server_from_args(argv: list[str] | None, description: str) -> tuple[TestServer, str, int]:
    """The test server the command line describes, and the host and port to serve it on."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--schedule", default="{}", help="Schedule fields as JSON")
    ap.add_argument("--api-key", default=os.environ.get("TESTSERVER_API_KEY"))
    for f in dataclasses.fields(Schedule):
        if f.type in ("float", "int"):
            ap.add_argument(
                f"--{f.name.replace('_', '-')}", type=float if f.type == "float" else int
            )
    args = ap.parse_args(argv)
    fields = json.loads(args.schedule)
    for f in dataclasses.fields(Schedule):
        v = getattr(args, f.name, None)
        if v is not None:
            fields[f.name] = v
    return TestServer(Schedule(**fields), api_key=args.api_key), args.host, args.port


def serve_until_killed(serve: Serve) -> None:
    """Start a server (``serve``: as ``serve_in_thread``'s), print ``READY <port>``, and serve
    until the process is stopped."""

    async def forever() -> None:
        port, _ = await serve()
        print(f"READY {port}", flush=True)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        run_loop(forever())


def main(argv: list[str] | None = None) -> None:
    server, host, port = server_from_args(argv, __doc__.split("\n")[0])
    serve_until_killed(lambda: server.serve(host, port))


if __name__ == "__main__":
    main()
