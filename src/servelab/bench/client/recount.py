"""The client's re-count of output tokens, spread over the event loop's turns.

Re-tokenizing a finished request's text is the costliest thing the client does per
request (a few microseconds per token, all in one call). In a closed loop many streams
finish together: counted inline, a wave of 200 finished requests held the loop for tens
of milliseconds, and every stream still running was read (and stamped, if its reads
coalesced) that much later. Here the counts queue and one runs per loop turn, so the
loop polls its sockets between any two of them and is held for one count at most. The
stream does not wait for its count (``client.send`` leaves it in ``Outcome.counting``):
the runner starts its next request at once and writes the record when it is counted.
"""

from __future__ import annotations

import asyncio
from collections import deque

from servelab.bench.workloads.prompts import TokenizerLike


class Recounter:
    """``await count(text)``: the number of tokens in ``text``, one count per loop turn."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self.tokenizer = tokenizer
        self._queue: deque[tuple[str, asyncio.Future[int]]] = deque()
        self._drainer: asyncio.Task[None] | None = None

    async def count(self, text: str) -> int:
        if not text:
            return 0
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        self._queue.append((text, fut))
        if self._drainer is None or self._drainer.done():
            self._drainer = loop.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        queue = self._queue
        while queue:
            text, fut = queue.popleft()
            if fut.done():  # its request was cancelled while it waited
                continue
            try:
                fut.set_result(len(self.tokenizer.encode(text, add_special_tokens=False)))
            except Exception as e:  # noqa: BLE001 - the waiting request raises it
                fut.set_exception(e)
            await asyncio.sleep(0)  # a loop turn (sockets polled) before the next count
