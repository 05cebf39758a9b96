"""Send one planned request to an OpenAI-compatible endpoint and build its ClientRecord.

Measurement rules (docs/metrics.md):
- ``actual_send`` is taken just before the request is handed to the connection;
  ``intended_send`` comes from the arrival schedule.
- A chunk counts as token-bearing when it carries output text (completions ``text``,
  chat ``delta.content``, ``delta.tool_calls``, or reasoning: ``delta.reasoning_content``
  / ``delta.reasoning``). Role-only, empty and usage-only chunks are not token chunks, so
  they never set TTFT. The first token chunk that is not reasoning sets TTFO.
- Tokens per chunk: from the server's running ``usage`` when it streams one in every
  chunk (vLLM's ``continuous_usage_stats``); otherwise one per chunk, redistributed
  by re-tokenizing the output when the server's total says chunks carried several.
- ``output_tokens``/``input_tokens`` come from the server's ``usage`` (``token_source
  = "usage"``); without usage, or with one the stream disproves (``bench.client.usagecheck``:
  the claim goes to ``disputed_usage``), from the client's re-count (``"client"``), which
  is also stored in ``client_output_tokens`` for the disagreement check.
- A stream ends at ``data: [DONE]``: an event after it is not part of the response (its
  text, tokens and time are ignored, and the stream's ``done`` is the ``[DONE]`` event's
  arrival); ``Target.streams_past_done`` counts the streams that sent one, for one warning.
- A 200 stream that ends with ``[DONE]`` and carried no output token is an error
  (``no_output``); a stream request answered with a whole non-SSE body is one too
  (``not_streamed``), whatever the body held.
- Errors, timeouts and cut streams are recorded with what arrived; nothing is dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from servelab.bench.client.http import HttpClient, StreamResult
from servelab.bench.client.recount import Recounter
from servelab.bench.client.requestid import RequestIdHeader
from servelab.bench.client.serverfigures import MalformedFigures, figures_from, ignored
from servelab.bench.client.usagecheck import usage_plausible
from servelab.bench.workloads.prompts import TokenizerLike
from servelab.bench.workloads.request_plan import PlannedRequest
from servelab.vocab import ClientRecord

_decode = msgspec.json.Decoder().decode


class _Function(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class _ToolCall(msgspec.Struct):
    function: _Function | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[_ToolCall] | None = None


def _tool_text(calls: list[_ToolCall] | None) -> str | None:
    """The streamed part of tool calls (name and argument fragments): output tokens too."""
    if not calls:
        return None
    parts = [(c.function.name or "") + (c.function.arguments or "") for c in calls if c.function]
    return "".join(parts) or None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None


class _Chunk(msgspec.Struct):
    """The fields of a streamed chunk the client reads; typed decoding skips the rest."""

    choices: list[_Choice] | None = None
    usage: dict[str, Any] | None = None
    servelab: dict[str, Any] | None = None
    error: Any = None
    # Other servers' per-request figures (bench/client/serverfigures.py), kept undecoded here.
    metrics: Any = None
    timings: Any = None
    meta_info: Any = None


class _Id(msgspec.Struct):
    id: Any = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode
_decode_id = msgspec.json.Decoder(_Id).decode  # the first event's only: nothing more per chunk
_encode = msgspec.json.Encoder().encode


@dataclass
class Target:
    """Where and how to send: the endpoint kind and the request options."""

    url: str
    model: str
    endpoint: str = "completions"  # or "chat"
    api_key: str | None = None
    strict_openai: bool = False  # send only OpenAI's own fields (no min_tokens/ignore_eos)
    timeout: float | None = 600.0
    tokenizer: TokenizerLike | None = None  # for the client re-count
    extra_body: dict[str, Any] = field(default_factory=dict)
    extra_headers: dict[str, str] = field(default_factory=dict)
    # X-Request-Id, a UUID per request (bench/client/requestid.py), so that every record joins the
    # server's own logs and, on a servelab server, its timelines.
    request_id_header: bool = True
    # open each stage's connections inside its measured window (set-up counted in TTFT)
    # instead of before its clock starts (bench/plan_runner.py)
    cold_connections: bool = False
    ids: RequestIdHeader = field(init=False, repr=False, compare=False)
    # streams that sent data events after data: [DONE] (ignored), for the run's one warning
    streams_past_done: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.ids = RequestIdHeader(self.request_id_header)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def headers(self, sent_id: str | None) -> dict[str, str]:
        """The request's headers; ``sent_id`` goes in ``X-Request-Id`` (None: no header)."""
        h = {**self.extra_headers, "Content-Type": "application/json"}
        if sent_id is not None:
            h["X-Request-Id"] = sent_id
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


@dataclass
class Outcome:
    """A finished request: its record and the text the server returned.

    ``counting`` (only when ``send`` was given a recounter) is the task that settles the
    record's token counts; the record is final once it is done.
    """

    record: ClientRecord
    text: str
    counting: asyncio.Task[None] | None = None


def request_body(
    target: Target, req: PlannedRequest, prompt: str | list[dict[str, str]]
) -> dict[str, Any]:
    """The JSON body: exact output length via ``min_tokens`` + ``ignore_eos`` unless strict
    or not ``req.force_length`` (then ``max_tokens`` is only a limit)."""
    stream, priority, max_tokens = req.tags.stream, req.tags.priority, req.max_tokens
    body: dict[str, Any] = {"model": target.model, "max_tokens": max_tokens, "stream": stream}
    if target.endpoint == "chat":
        body["messages"] = prompt
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    if not target.strict_openai:
        if req.force_length:
            body["min_tokens"] = max_tokens
            body["ignore_eos"] = True
        if stream:
            body["stream_options"]["continuous_usage_stats"] = True
        if priority:
            body["priority"] = priority
    body.update(target.extra_body)
    if req.tags.temperature is not None:  # the class's own, over the run's --sampling
        body["temperature"] = req.tags.temperature
    return body


class _Collector:
    """Turns SSE payloads into chunk times, token counts and text, as they arrive."""

    def __init__(self, rec: ClientRecord, chat: bool) -> None:
        self.rec = rec
        self.chat = chat
        self.texts: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.continuous = True  # every token chunk so far carried a running usage
        self.accounted = 0
        self.done_marker = False
        self.done_at: float | None = None  # when data: [DONE] arrived
        self.past_done = 0  # data events after [DONE], ignored
        self.error: str | None = None
        self.reasoning_chunks: list[int] = []  # indices of the chunks that carried reasoning
        self.first_event = True

    def on_event(self, t: float, payload: bytes) -> None:
        if self.done_marker:  # the stream ended at [DONE]; a misbehaving server sent more
            self.past_done += 1
            return
        if payload == b"[DONE]":
            self.done_marker, self.done_at = True, t
            return
        if self.first_event:
            self.first_event = False
            self._response_id(payload)
        try:
            ev = _decode_chunk(payload)
        except msgspec.DecodeError:
            self._odd_event(payload)
            return
        if ev.error:
            err = ev.error
            msg = err.get("message", err) if isinstance(err, dict) else err
            self.error = f"server_error: {msg}"
            return
        usage = ev.usage
        if usage:
            self.usage = usage
        if ev.servelab is not None:
            self.rec.server_timeline = ev.servelab
        elif ev.metrics is not None or ev.timings is not None or ev.meta_info is not None:
            self._figures({"metrics": ev.metrics, "timings": ev.timings, "meta_info": ev.meta_info})
        text = None
        reasoning = False
        if ev.choices:
            c = ev.choices[0]
            if c.delta is not None:
                d = c.delta
                text = d.content or _tool_text(d.tool_calls)
                if not text:
                    text = d.reasoning_content or d.reasoning
                    reasoning = bool(text)
            else:
                text = c.text
        if not text:
            return
        rec = self.rec
        if reasoning:
            self.reasoning_chunks.append(len(rec.chunk_times))
        elif rec.first_output is None:
            rec.first_output = t
        rec.chunk_times.append(t)
        self.texts.append(text)
        if usage and "completion_tokens" in usage:
            carried = max(1, usage["completion_tokens"] - self.accounted)
            self.accounted = usage["completion_tokens"]
        else:
            carried, self.continuous = 1, False
            self.accounted += 1
        rec.chunk_tokens.append(carried)

    def _figures(self, objects: dict[str, Any]) -> None:
        """Another server's per-request figures; unreadable ones are kept as a reason only
        (the run warns once about them), never raised."""
        try:
            got = figures_from(objects)
        except MalformedFigures as e:
            got = ignored(str(e))
        if got is not None:
            self.rec.server_timeline = got

    def _response_id(self, payload: bytes) -> None:
        """The server's own id for the response (the chunks' ``id``), from its first event."""
        try:
            got = _decode_id(payload).id
        except msgspec.DecodeError:
            return
        if isinstance(got, str):
            self.rec.response_id = got

    def _odd_event(self, payload: bytes) -> None:
        """An event that is not a chunk object: an error string, or not JSON at all."""
        try:
            d = _decode(payload)
        except msgspec.DecodeError:
            self.error = f"bad_response: not JSON: {payload[:120]!r}"
            return
        if isinstance(d, dict) and d.get("error"):
            self.error = f"server_error: {d['error']}"

    def on_body(self, t: float, payload: bytes) -> None:
        """A whole non-streamed response (or an error body)."""
        try:
            d = _decode(payload) if payload else {}
        except msgspec.DecodeError:
            self.error = f"bad_response: not JSON: {payload[:120]!r}"
            return
        if isinstance(d, dict) and d.get("error"):
            err = d["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return
        if not isinstance(d, dict):
            self.error = "bad_response: expected a JSON object"
            return
        self.usage = d.get("usage")
        if isinstance(d.get("id"), str):
            self.rec.response_id = d["id"]
        if d.get("servelab") is not None:
            self.rec.server_timeline = d["servelab"]
        else:
            self._figures(d)
        choices = d.get("choices") or [{}]
        c = choices[0]
        msg = c.get("message") or {}
        text = msg.get("content") if self.chat else c.get("text")
        thought = msg.get("reasoning_content") or msg.get("reasoning") or ""
        self.texts.append(thought + (text or ""))
        self.rec.chunk_times.append(t)
        self.rec.chunk_tokens.append(0)
        if text or msg.get("tool_calls"):
            self.rec.first_output = t


async def send(
    http: HttpClient,
    target: Target,
    req: PlannedRequest,
    *,
    prompt: str | list[dict[str, str]],
    intended_send: float,
    request_id: str | None = None,
    stage: str | None = None,
    on_abort: Callable[[ClientRecord], None] | None = None,
    recounter: Recounter | None = None,
) -> Outcome:
    """Send one planned request and return its record (every failure is recorded, not raised).

    What is per send comes beside it: ``prompt`` is what the body carries (the plan's
    prompt after the conversation so far, or chat messages), ``request_id`` the id it is
    sent and recorded under (the plan's by default), ``stage`` the sweep stage it runs in.
    If the caller is cancelled mid-request, the record of what arrived so far goes to
    ``on_abort`` (error ``aborted: ...``) before the cancellation propagates. The request
    carries a fresh UUID in ``X-Request-Id`` (``target.ids``); a 4xx answer that may be the
    header's fault is retried once without it (bench/client/requestid.py). The client
    re-count of the output (with ``target.tokenizer``) runs inline, or, given a
    ``recounter`` (which many streams share), waits its turn there in ``Outcome.counting``
    while the caller goes on: its next request need not wait for a count.
    """
    request_id = request_id or req.request_id
    stream = req.tags.stream
    forced = not target.strict_openai and req.force_length
    body = _encode(request_body(target, req, prompt))
    rec = ClientRecord.for_request(
        request_id,
        req.tags,
        stage=stage,
        intended_send=intended_send,
        actual_send=0.0,
        input_tokens=req.prompt_tokens,
        requested_output_tokens=req.max_tokens if forced else None,
    )
    chat = target.endpoint == "chat"
    ids = target.ids
    sent_id = rec.sent_request_id = ids.new_id()
    col, res = _Collector(rec, chat), StreamResult()
    try:
        await _post(http, target, body, sent_id, col, res, stream)
        if sent_id is not None:
            ids.answered(res.status)
            if ids.should_retry(res.status):
                first = _error(res, col, stream, target.timeout) or f"http_{res.status}"
                _restart(rec)
                col, res = _Collector(rec, chat), StreamResult()
                await _post(http, target, body, None, col, res, stream)
                ids.retried(res.status, first)
    except asyncio.CancelledError:
        if on_abort is not None:
            _fill(rec, res, col, target.tokenizer)
            rec.error = "aborted: the benchmark was interrupted while this request was in flight"
            on_abort(rec)
        raise
    rec.error = _error(res, col, stream, target.timeout)
    if col.past_done:
        target.streams_past_done += 1
    if recounter is None or target.tokenizer is None:
        return Outcome(rec, _fill(rec, res, col, target.tokenizer))
    _wire_times(rec, res, col)
    text = "".join(col.texts)
    counting = asyncio.get_running_loop().create_task(
        _count_later(rec, col, text, target.tokenizer, recounter)
    )
    return Outcome(rec, text, counting)


async def _post(
    http: HttpClient,
    target: Target,
    body: bytes,
    sent_id: str | None,
    col: _Collector,
    res: StreamResult,
    stream: bool,
) -> None:
    handler = col.on_event if stream else col.on_body
    await http.post_stream(target.path, body, target.headers(sent_id), handler, target.timeout, res)


def _restart(rec: ClientRecord) -> None:
    """Forget a refused try: the request is sent again, without ``X-Request-Id``."""
    rec.sent_request_id = rec.response_id = rec.server_timeline = rec.first_output = None
    rec.chunk_times, rec.chunk_tokens = [], []


def _wire_times(rec: ClientRecord, res: StreamResult, col: _Collector) -> None:
    rec.actual_send = res.sent
    rec.first_byte = res.first_byte
    rec.done = col.done_at if col.past_done else res.last_byte  # bytes after [DONE] are not it
    rec.status = res.status
    rec.server_request_id = res.headers.get("x-request-id")
    rec.new_connection = res.new_connection
    rec.dns_time, rec.connect_time, rec.tls_time = res.dns, res.connect, res.tls
    rec.connected, rec.request_written = res.connected, res.written


def _fill(
    rec: ClientRecord, res: StreamResult, col: _Collector, tokenizer: TokenizerLike | None
) -> str:
    """Copy the wire times into the record and settle its token counts; return the text."""
    _wire_times(rec, res, col)
    text = "".join(col.texts)
    counted = None
    if tokenizer is not None:
        counted = len(tokenizer.encode(text, add_special_tokens=False)) if text else 0
    _settle_counts(rec, col, tokenizer, counted)
    return text


async def _count_later(
    rec: ClientRecord, col: _Collector, text: str, tokenizer: TokenizerLike, recounter: Recounter
) -> None:
    _settle_counts(rec, col, tokenizer, await recounter.count(text))


def _settle_counts(
    rec: ClientRecord, col: _Collector, tokenizer: TokenizerLike | None, counted: int | None
) -> None:
    """The record's token counts, given the client re-count (None: no tokenizer)."""
    rec.client_output_tokens = counted
    _finish_counts(rec, col, tokenizer)
    if not rec.stream and rec.chunk_tokens:
        rec.chunk_tokens[0] = rec.output_tokens


def _error(res: Any, col: _Collector, stream: bool, timeout: float | None) -> str | None:
    if res.status is not None and res.status != 200:
        detail = (col.error or "error response").removeprefix("server_error: ")
        return f"http_{res.status}: {detail}"
    if res.error == "timeout":
        return f"timeout: no complete response within {timeout:g}s"
    if res.error is not None:
        return res.error
    ctype = res.headers.get("content-type", "")
    if stream and res.status == 200 and not ctype.startswith("text/event-stream"):
        answered = ctype.split(";")[0].strip() or "a body without a content type"
        return f"not_streamed: server did not stream: answered {answered}"
    if col.error is not None:
        return col.error
    if stream and not col.done_marker:
        return "partial: the stream ended without data: [DONE]"
    if stream and not col.rec.chunk_times:
        return "no_output: the stream ended with data: [DONE] and no output token"
    return None


def _finish_counts(rec: ClientRecord, col: _Collector, tokenizer: TokenizerLike | None) -> None:
    usage = col.usage or {}
    n_chunks = len(rec.chunk_times)
    disputed = False
    if "completion_tokens" in usage:
        claimed = int(usage["completion_tokens"])
        rec.input_tokens = int(usage.get("prompt_tokens", rec.input_tokens))
        if usage_plausible(claimed, n_chunks if rec.stream else None, rec.client_output_tokens):
            rec.output_tokens = claimed
            rec.token_source = "usage"
        else:
            rec.disputed_usage, disputed = claimed, True
    if "completion_tokens" not in usage or disputed:
        if rec.client_output_tokens is not None:
            rec.output_tokens = rec.client_output_tokens
        else:  # a disputed running usage also set the per-chunk counts: one per chunk instead
            rec.output_tokens = n_chunks if disputed else sum(rec.chunk_tokens)
        rec.token_source = "client"
    if (
        rec.stream
        and n_chunks
        and (disputed or not col.continuous)
        and rec.output_tokens != sum(rec.chunk_tokens)
    ):
        rec.chunk_tokens = _attribute_tokens(col.texts, rec.output_tokens, tokenizer)
    details = usage.get("completion_tokens_details") or {}
    if details.get("reasoning_tokens") is not None and not disputed:
        rec.reasoning_tokens = int(details["reasoning_tokens"])
    else:
        rec.reasoning_tokens = sum(rec.chunk_tokens[i] for i in col.reasoning_chunks)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None and rec.server_timeline is not None:
        cached = rec.server_timeline.get("cached_prompt_tokens")
    rec.cached_tokens = None if cached is None else int(cached)


def _attribute_tokens(texts: list[str], total: int, tokenizer: TokenizerLike | None) -> list[int]:
    """Split ``total`` tokens over the chunks that carried ``texts``.

    With a tokenizer, the output is re-tokenized and each token goes to the chunk in
    which its text ends; otherwise tokens are spread in proportion to characters.
    Every chunk carries at least one token, and the counts add up to ``total``.
    """
    n = len(texts)
    if total <= n:
        return [1] * n
    counts = [1] * n
    if tokenizer is not None:
        ids = tokenizer.encode("".join(texts), add_special_tokens=False)
        ends, pos = [], 0
        for t in texts:
            pos += len(t)
            ends.append(pos)
        c, chunk, per = 0, 0, [0] * n
        for tid in ids:
            c += len(tokenizer.decode([tid], skip_special_tokens=False))
            while chunk < n - 1 and c > ends[chunk]:
                chunk += 1
            per[chunk] += 1
        counts = [max(1, p) for p in per]
    else:
        chars = sum(len(t) for t in texts) or n
        counts = [max(1, round(total * len(t) / chars)) for t in texts]
    # Reconcile with the server's total, adjusting the largest chunks.
    diff = total - sum(counts)
    order = sorted(range(n), key=lambda i: -counts[i])
    i = 0
    while diff != 0 and n:
        j = order[i % n]
        if diff > 0:
            counts[j] += 1
            diff -= 1
        elif counts[j] > 1:
            counts[j] -= 1
            diff += 1
        i += 1
        if i > 10 * (n + abs(diff)) + 10:
            break
    return counts
