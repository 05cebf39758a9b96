"""OpenAI request parsing/validation and response shapes (completions and chat).

``parse_completion``/``parse_chat`` turn a raw body into a ``ParsedRequest`` or raise
APIError(400/404) naming the field. Token counting and the context check happen after
tokenisation in ``finalize`` (the API process tokenises; the core gets token ids).
Response builders return plain dicts; ``sse`` frames one as ``data: {json}\\n\\n``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from servelab.engine.sampling_params import SamplingParams
from servelab.server.bounds import json_too_deep, least_tokens
from servelab.server.openai_errors import APIError

SSE_DONE = b"data: [DONE]\n\n"
_MAX_SEED = 2**63 - 1
_GREEDY_BELOW = 1e-5  # temperatures this small are greedy (vLLM does the same)
# What msgpack (the IPC to the core) carries: a bigger integer is a 400 naming its field.
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
# Limits at the door (docs/design/server.md compares each with vLLM and OpenAI).
MAX_JSON_DEPTH = 64
MAX_MESSAGES = 2048  # OpenAI's cap
MAX_STOP_CHARS = 256  # stop strings are matched against the text tail at every step
MAX_STOP_TOKEN_IDS = 256
DEFAULT_MAX_STOP_SEQUENCES = 4  # OpenAI's cap; --max-stop-sequences raises it


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions. Unknown fields are ignored."""

    model: str | None = None
    max_tokens: Int64 | None = None
    min_tokens: Int64 = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    n: Int64 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: Int64 = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: Any
    echo: bool = False
    best_of: Int64 | None = None
    suffix: str | None = None
    logprobs: Int64 | None = None
    add_special_tokens: bool = True


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = None
    tools: list[Any] | None = None


@dataclass
class ModelLimits:
    """What a request is validated against."""

    names: tuple[str, ...]  # accepted values of `model` (the first is reported back)
    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int | None = None  # KV pool size: one request cannot outgrow it
    # bounds.longest_token_chars: a longer text cannot fit (None: no exact bound, no check)
    max_token_chars: int | None = None
    max_stop_sequences: int = DEFAULT_MAX_STOP_SEQUENCES


@dataclass
class ParsedRequest:
    """A validated request, before tokenisation (``text``) or with ids (``token_ids``)."""

    chat: bool
    text: str | None
    token_ids: list[int] | None
    add_special_tokens: bool
    sampling: dict[str, Any]  # SamplingParams fields, max_tokens possibly None
    priority: int
    stream: bool
    include_usage: bool


_FIELD_RE = re.compile(r"at `\$\.?([A-Za-z_]\w*)|field `([A-Za-z_]\w*)`")


def _decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    if not body.strip():
        raise APIError(
            400, "The request body is empty: send a JSON object (Content-Type: application/json)."
        )
    if json_too_deep(body, MAX_JSON_DEPTH):
        raise APIError(
            400, f"The request body nests arrays or objects deeper than {MAX_JSON_DEPTH} levels."
        )
    try:
        return msgspec.json.decode(body, type=kind)
    except RecursionError:  # depth hidden by brackets inside strings (bounds.json_too_deep)
        raise APIError(400, "The request body nests too deeply.") from None
    except msgspec.ValidationError as e:
        m = _FIELD_RE.search(str(e))
        param = (m.group(1) or m.group(2)) if m else None
        raise APIError(400, f"Invalid request: {e}", param=param) from None
    except msgspec.DecodeError as e:
        raise APIError(400, f"The request body is not valid JSON: {e}") from None


def _unsupported(req: _Common) -> None:
    if req.n != 1:
        raise APIError(
            400, f"n={req.n} is not supported: only n=1; send separate requests instead.", param="n"
        )
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value not in (None, 0, 0.0):
            raise APIError(400, f"{name} is not supported: leave it unset or 0.", param=name)
    if req.logit_bias:  # ignoring it would answer as if the bias had been applied
        raise APIError(400, "logit_bias is not supported: leave it unset.", param="logit_bias")
    if req.response_format is not None and req.response_format.get("type", "text") != "text":
        raise APIError(
            400, "response_format other than text is not supported.", param="response_format"
        )
    if req.stream_options is not None and not req.stream:
        raise APIError(
            400, "stream_options is only allowed with stream=true.", param="stream_options"
        )


def _check_model(req: _Common, limits: ModelLimits) -> None:
    if req.model is not None and req.model not in limits.names:
        raise APIError(
            404,
            f"The model `{req.model}` does not exist. This server serves `{limits.names[0]}` "
            "(see GET /v1/models).",
            param="model",
            code="model_not_found",
        )


def _check_ids(ids: list[int], limits: ModelLimits, param: str) -> None:
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < limits.vocab_size:
            raise APIError(
                400,
                f"{param} holds {t!r}, which is not a token id in [0, {limits.vocab_size}).",
                param=param,
            )


def _finite(name: str, value: float | None) -> None:
    if value is not None and not math.isfinite(value):
        raise APIError(400, f"{name} must be a finite number, got {value}.", param=name)


def _sampling(req: _Common, max_tokens: int | None, limits: ModelLimits) -> dict[str, Any]:
    _finite("temperature", req.temperature)
    _finite("top_p", req.top_p)
    temperature = 1.0 if req.temperature is None else req.temperature
    if 0 <= temperature < _GREEDY_BELOW:
        temperature = 0.0
    top_k = 0 if req.top_k is None or req.top_k == -1 else req.top_k
    if top_k < 0:
        raise APIError(
            400, f"top_k must be -1 or 0 (disabled) or positive, got {top_k}.", param="top_k"
        )
    if top_k >= limits.vocab_size:
        top_k = 0  # keeping every token is no filter
    if req.seed is not None and not 0 <= req.seed <= _MAX_SEED:
        raise APIError(400, f"seed must be in [0, 2**63 - 1], got {req.seed}.", param="seed")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    _check_stop(stop, limits)
    stop_ids = list(dict.fromkeys(req.stop_token_ids or []))
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise APIError(
            400,
            f"stop_token_ids holds {len(stop_ids)} distinct ids; at most {MAX_STOP_TOKEN_IDS} "
            "are allowed.",
            param="stop_token_ids",
        )
    _check_ids(stop_ids, limits, "stop_token_ids")
    fields = {
        "max_tokens": max_tokens,
        "min_tokens": req.min_tokens,
        "temperature": temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": top_k,
        "seed": req.seed,
        "stop": stop,
        "stop_token_ids": stop_ids,
        "ignore_eos": req.ignore_eos,
    }
    # Let SamplingParams check ranges now (max_tokens is checked after tokenisation).
    _make_params({**fields, "max_tokens": max_tokens or max(1, req.min_tokens)})
    return fields


def _check_stop(stop: list[str], limits: ModelLimits) -> None:
    # Every stop string is checked at every step of the core: a long list slows everyone.
    if len(stop) > limits.max_stop_sequences:
        raise APIError(
            400,
            f"stop holds {len(stop)} sequences; at most {limits.max_stop_sequences} are allowed "
            "(the server's --max-stop-sequences).",
            param="stop",
        )
    for s in stop:
        if not s:
            raise APIError(400, "stop strings must not be empty.", param="stop")
        if len(s) > MAX_STOP_CHARS:
            raise APIError(
                400,
                f"A stop string has {len(s)} characters; at most {MAX_STOP_CHARS} are allowed.",
                param="stop",
            )


def _check_chars(chars: int, max_tokens: int | None, limits: ModelLimits, param: str) -> None:
    """Refuse, before tokenising, a text that cannot fit: each token covers at most
    ``max_token_chars`` characters, so it needs at least ceil(chars / that) tokens."""
    longest, limit = limits.max_token_chars, limits.max_model_len
    if longest is None:
        return
    least = least_tokens(chars, longest)
    head = f"This model's maximum context length is {limit} tokens. However, the {param} has "
    why = f"no token of this model spans more than {longest} characters"
    if least >= limit:
        message = f"{head}{chars} characters, so at least {least} tokens ({why}). Shorten it."
    elif max_tokens is not None and least + max_tokens > limit:
        message = (
            f"{head}{chars} characters, so at least {least} tokens ({why}), and you requested "
            f"{max_tokens} for the completion. Shorten the {param} or lower max_tokens."
        )
    else:
        return
    raise APIError(
        400,
        message,
        param=param if least >= limit else "max_tokens",
        code="context_length_exceeded",
    )


def _check_context(n: int, max_tokens: int, limits: ModelLimits, param: str) -> None:
    limit = limits.max_model_len
    want = n + max_tokens
    if n >= limit or want > limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{want} tokens ({n} in the {param}, {max_tokens} for the completion). "
            f"Shorten the {param} or lower max_tokens.",
            param=param if n >= limit else "max_tokens",
            code="context_length_exceeded",
        )


def _make_params(fields: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from None


def _common(req: _Common, limits: ModelLimits, max_tokens: int | None) -> dict[str, Any]:
    _check_model(req, limits)
    _unsupported(req)
    return {
        "sampling": _sampling(req, max_tokens, limits),
        "priority": req.priority,
        "stream": req.stream,
        "include_usage": bool(req.stream_options and req.stream_options.include_usage),
    }


def parse_completion(body: bytes, limits: ModelLimits) -> ParsedRequest:
    req: CompletionRequest = _decode(body, CompletionRequest)
    if req.echo:
        raise APIError(400, "echo is not supported.", param="echo")
    if req.best_of not in (None, 1):
        raise APIError(400, "best_of > 1 is not supported.", param="best_of")
    if req.suffix:
        raise APIError(400, "suffix is not supported.", param="suffix")
    if req.logprobs is not None:
        raise APIError(400, "logprobs are not supported.", param="logprobs")
    # OpenAI's default for legacy completions is 16 tokens.
    common = _common(req, limits, 16 if req.max_tokens is None else req.max_tokens)
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        _check_chars(len(prompt), common["sampling"]["max_tokens"], limits, "prompt")
        return ParsedRequest(False, prompt, None, req.add_special_tokens, **common)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        # Before checking each id: millions of them cost seconds of Python.
        _check_context(len(prompt), common["sampling"]["max_tokens"], limits, "prompt")
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        _check_ids(prompt, limits, "prompt")
        return ParsedRequest(False, None, list(prompt), False, **common)
    if (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, (str, list)) for p in prompt)
    ):
        raise APIError(
            400, "Batched prompts are not supported: send one prompt per request.", param="prompt"
        )
    raise APIError(
        400, "prompt must be a non-empty string or a non-empty list of token ids.", param="prompt"
    )


def parse_chat(body: bytes, limits: ModelLimits) -> tuple[ParsedRequest, list[dict[str, str]]]:
    """The request and its messages as plain dicts, ready for the chat template."""
    req: ChatRequest = _decode(body, ChatRequest)
    if req.logprobs:
        raise APIError(400, "logprobs are not supported.", param="logprobs")
    if req.tools:
        raise APIError(400, "tools are not supported.", param="tools")
    if not req.messages:
        raise APIError(400, "messages must hold at least one message.", param="messages")
    if len(req.messages) > MAX_MESSAGES:
        raise APIError(
            400,
            f"messages holds {len(req.messages)} messages; at most {MAX_MESSAGES} are allowed.",
            param="messages",
        )
    messages = []
    for msg in req.messages:
        content = msg.content
        if isinstance(content, list):
            if any(p.type != "text" or p.text is None for p in content):
                raise APIError(400, "Only text content parts are supported.", param="messages")
            content = "".join(p.text or "" for p in content)
        messages.append({"role": msg.role, "content": content or ""})
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    common = _common(req, limits, max_tokens)
    # The template renders every content (perhaps trimmed) plus its own markup.
    chars = sum(len(m["content"].strip()) for m in messages)
    _check_chars(chars, max_tokens, limits, "messages")
    return ParsedRequest(True, None, None, False, **common), messages


def finalize(parsed: ParsedRequest, token_ids: list[int], limits: ModelLimits) -> SamplingParams:
    """Check the prompt against the context and fill the default max_tokens (the rest of it)."""
    param = "messages" if parsed.chat else "prompt"
    if not token_ids:
        raise APIError(
            400, f"The {param} is empty after tokenisation: send some text.", param=param
        )
    n = len(token_ids)
    fields = dict(parsed.sampling)
    if fields["max_tokens"] is None:
        fields["max_tokens"] = limits.max_model_len - n
    _check_context(n, fields["max_tokens"], limits, param)
    want = n + fields["max_tokens"]
    # The last sampled token never needs K/V (the engine's own rule).
    if limits.kv_capacity_tokens is not None and want - 1 > limits.kv_capacity_tokens:
        raise APIError(
            400,
            f"This request needs KV cache for {want - 1} tokens but the server's KV pool holds "
            f"{limits.kv_capacity_tokens}. Lower max_tokens or shorten the {param}.",
            param="max_tokens",
        )
    return _make_params(fields)


# ---- responses ----------------------------------------------------------------


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class ResponseShape:
    """Builds the response objects of one request (completion or chat, stream or not)."""

    chat: bool
    request_id: str
    model: str
    created: int

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str, finish_reason: str | None, first: bool) -> dict[str, Any]:
        """One streamed chunk; the first chat delta also carries the assistant role."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": use}

    def full(self, text: str, finish_reason: str | None, use: dict[str, int]) -> dict[str, Any]:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            return {**self._head("chat.completion"), "choices": [choice], "usage": use}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": use}
