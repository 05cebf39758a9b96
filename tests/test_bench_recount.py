"""The client re-count: exact counts, and a wave of finished requests never holds the loop."""

from __future__ import annotations

import asyncio
import itertools

from servelab.bench.client.recount import Recounter
from servelab.testing.tokenizers import tiny_tokenizer


class _LoggingTokenizer:
    """Counts characters and logs each call, to see what ran between two counts."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.log.append(f"count {text}")
        return [0] * len(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def test_counts_match_the_tokenizer():
    tok = tiny_tokenizer()
    texts = ["", "hello world", "The quick brown fox jumps over the lazy dog. " * 20, " x\n\ny"]

    async def go() -> list[int]:
        r = Recounter(tok)
        return list(await asyncio.gather(*(r.count(t) for t in texts)))

    assert asyncio.run(go()) == [len(tok.encode(t)) for t in texts]


def test_the_loop_gets_a_turn_between_any_two_counts():
    log: list[str] = []

    async def other_work() -> None:
        for _ in range(50):
            log.append("turn")
            await asyncio.sleep(0)

    async def go() -> list[int]:
        r = Recounter(_LoggingTokenizer(log))
        ticker = asyncio.get_running_loop().create_task(other_work())
        counts = await asyncio.gather(*(r.count("ab" * i) for i in range(1, 21)))
        ticker.cancel()
        return list(counts)

    assert asyncio.run(go()) == [2 * i for i in range(1, 21)]
    counts = [i for i, e in enumerate(log) if e.startswith("count")]
    assert len(counts) == 20
    assert all(b - a > 1 for a, b in itertools.pairwise(counts)), "two counts ran in one loop turn"


def test_a_cancelled_request_is_not_counted():
    log: list[str] = []

    async def go() -> int:
        r = Recounter(_LoggingTokenizer(log))
        first = asyncio.ensure_future(r.count("first"))
        dropped = asyncio.ensure_future(r.count("dropped"))
        await asyncio.sleep(0)  # both queued
        dropped.cancel()
        return await first

    assert asyncio.run(go()) == 5
    assert log == ["count first"]
