"""Turning a request body into token ids: validate, apply the chat template, tokenise.

A small body is prepared on the event loop: the hop to another process would cost more.
A body over ``OFF_LOOP_BYTES`` goes to a ``PreparePool`` worker process that holds its own
tokenizer. A thread is not enough: on a 10 MB body msgspec's decoder holds the GIL for
0.4 s (300,000 chat messages) to 0.85 s (8 million token ids), the bracket scan and the
GC for tens of ms more, and ``/health`` would wait on each. In a worker process the API's
event loop only copies the body out and the (context-bounded) token ids back.

A worker that dies (killed, out of memory) fails only the request it held, with a 503;
the next request gets a fresh pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from servelab.server.heap import M_MMAP_THRESHOLD, MALLOPT
from servelab.server.openai_errors import APIError
from servelab.server.openai_protocol import ModelLimits, ParsedRequest, parse_chat, parse_completion

log = logging.getLogger("servelab.server")

OFF_LOOP_BYTES = 32_768  # bigger bodies are prepared in a worker process
TRIM_BYTES = 1 << 20  # after a body this big, hand freed heap memory back to the OS
_WORKERS = 2
_WORKER_NICENESS = 10


def prepare(tokenizer: Any, limits: ModelLimits, body: bytes, chat: bool) -> ParsedRequest:
    """Validate, template and tokenise one request body (the limits run first)."""
    if chat:
        parsed, messages = parse_chat(body, limits)
        try:
            parsed.text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 -- jinja errors, the template's raise_exception()
            raise APIError(
                400, f"The chat template rejected the messages: {e}", param="messages"
            ) from None
    else:
        parsed = parse_completion(body, limits)
    if parsed.token_ids is None:
        parsed.token_ids = tokenizer.encode(parsed.text or "", parsed.add_special_tokens)
    return parsed


# ---- the worker process ----

_worker: dict[str, Any] = {}


def load_tokenizer(model: str) -> Any:
    from servelab.modelcore.tokenizer import Tokenizer

    tok = Tokenizer.from_model(model)
    # Compile the chat template now rather than inside the first chat request.
    with contextlib.suppress(Exception):  # no template, or one that rejects this message
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    return tok


def _init_worker(model: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the API process's to handle
    # A worker chewing a 10 MB body for half a second shares the CPU with the API process
    # (and, on a small machine, its one core): at equal priority /health waits behind it
    # (docs/design/server.md). At a lower priority the API's loop preempts it on waking.
    os.nice(_WORKER_NICENESS)
    if MALLOPT is not None:
        # glibc raises its mmap threshold after the first big free, and then keeps the heap
        # that later big bodies grow. A fixed threshold keeps every buffer of TRIM_BYTES or
        # more in its own mapping, returned on free.
        MALLOPT(M_MMAP_THRESHOLD, TRIM_BYTES)
    _worker["tokenizer"] = load_tokenizer(model)


def _prepare_in_worker(limits: ModelLimits, body: bytes, chat: bool) -> ParsedRequest:
    return prepare(_worker["tokenizer"], limits, body, chat)


def _ready() -> bool:
    return "tokenizer" in _worker


class PreparePool:
    """Worker processes that prepare big bodies, each with the model's tokenizer."""

    def __init__(self, model: str) -> None:
        self._model = model
        self._pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        # spawn, not fork: the API process has threads (ZeroMQ's, the loop's executor).
        return ProcessPoolExecutor(
            _WORKERS,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(self._model,),
        )

    async def start(self) -> None:
        """Start every worker and load its tokenizer now, not in the first big request."""
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._pool, _ready) for _ in range(_WORKERS)))

    async def prepare(self, limits: ModelLimits, body: bytes, chat: bool) -> ParsedRequest:
        pool = self._pool
        try:
            return await asyncio.get_running_loop().run_in_executor(
                pool, _prepare_in_worker, limits, body, chat
            )
        except BrokenProcessPool:
            if pool is self._pool:  # the first request to see it replaces the pool
                log.error("servelab serve: a request-preparation worker died; restarting them")
                pool.shutdown(wait=False, cancel_futures=True)
                self._pool = self._new_pool()
            raise APIError(
                503,
                "The worker preparing this request died (was the body too big for memory?); retry.",
            ) from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
