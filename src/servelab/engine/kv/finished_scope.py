"""A prefix cache that only finished requests feed, as llama-server's is
(``prefix_cache_scope="finished"``).

vLLM and SGLang share one prefix cache between all requests: a prompt reuses any cached
block it starts with, a running request's included. llama-server keeps a request's tokens
in its slot while it runs and, once it has finished, in the idle slot or the RAM prompt
cache (``--cache-ram``) that the next request's slot loads the best match from
(tools/server/server.cpp, ``get_available_slot`` and the prompt cache). So a prompt reuses
what finished requests computed, never what a running one holds: four RAG prompts sharing
a document, sent together, each compute it (live llama-server at four slots: 20% of prompt
tokens cached, a shared cache 36%).

Contract, on top of the wrapped cache's (``kv_cache_plain.PlainKVCache``):

- ``lookup`` returns the wrapped cache's hit cut to the longest prefix of the prompt that a
  finished request's tokens (prompt and output so far) began with; it changes nothing.
- ``allocate`` of a request admitted with a hit that keeps at least ``KEEP`` of the best
  finished request's tokens continues them in its slot: no other request reuses them
  until this one finishes. A hit keeping less (a shared system prompt) takes nothing.
- ``free`` of a request makes its tokens reusable from then on. The most recent finished
  requests are remembered, up to the pool's size in tokens (no cache could hold more).
- Blocks, their hand-out order and evictions are the wrapped cache's: the scope only
  shortens hits, so a block is reused only while the wrapped cache still holds it.

The scope lives beside the cache, so the fast and the plain cache take it alike
(``FinishedScopeKVCache``, ``PlainFinishedScopeKVCache``).
"""

from __future__ import annotations

from servelab.engine.kv.kv_cache import KVCacheManager
from servelab.engine.kv.kv_cache_plain import PlainKVCache, PrefixHit

# The share of a slot's tokens a prompt keeps to continue them in place. Inferred, not read
# from llama-server's source: with it the cached share of every live run's prompts matches
# (docs/design/twin.md, "llama-server's prefix cache").
KEEP = 0.5


class FinishedPrefixes:
    """Finished requests' token lists, each reusable by one running request at a time, the
    most recent kept up to ``capacity`` tokens."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: dict[int, list[int]] = {}  # in the order they finished
        self._tokens = 0
        self._next = 0

    def best(self, tokens: list[int]) -> tuple[int | None, int]:
        """The entry sharing the longest prefix with ``tokens`` and that length; the oldest
        on a tie, (None, 0) when none shares a token."""
        found, most = None, 0
        for key, held in self._entries.items():
            n = common_prefix(held, tokens)
            if n > most:
                found, most = key, n
        return found, most

    def add(self, tokens: list[int]) -> None:
        """Remember a finished request's tokens, forgetting the oldest past capacity."""
        if not tokens:
            return
        self._entries[self._next] = list(tokens)
        self._next += 1
        self._tokens += len(tokens)
        while self._tokens > self.capacity and len(self._entries) > 1:
            self.take(next(iter(self._entries)))

    def take(self, key: int) -> None:
        """Forget an entry."""
        self._tokens -= len(self._entries.pop(key))

    def continue_best(self, tokens: list[int]) -> None:
        """A prompt admitted with a hit: where it keeps at least ``KEEP`` of the best entry,
        it continues that entry in place and no other request can reuse it; else the entry
        stays (a slot's tokens stay reusable when a prompt keeping less of them takes the
        slot: a new chat session's turn sharing only the system prompt leaves the previous
        session's history to its next turn)."""
        key, shared = self.best(tokens)
        if key is not None and shared >= KEEP * len(self._entries[key]):
            self.take(key)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class FinishedScope:
    """The rules of the module doc over a ``KVCacheBase`` implementation (a mixin)."""

    block_size: int

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        super().__init__(num_blocks, block_size, enable_prefix_caching)  # type: ignore[call-arg]
        self.finished = FinishedPrefixes(num_blocks * block_size)
        self._tokens: dict[str, list[int]] = {}  # each live request's token list (it grows)

    def lookup(self, request_id: str, token_ids: list[int]) -> PrefixHit:
        hit: PrefixHit = super().lookup(request_id, token_ids)  # type: ignore[misc]
        self._tokens[request_id] = token_ids
        if not hit.blocks:
            return hit
        keep = min(len(hit.blocks), self.finished.best(token_ids)[1] // self.block_size)
        return PrefixHit(hit.blocks[:keep], keep * self.block_size, hit.num_queried_tokens)

    def allocate(self, request_id: str, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        admitted = not self.block_table(request_id)  # type: ignore[attr-defined]
        ok: bool = super().allocate(request_id, num_tokens, hit)  # type: ignore[misc]
        if ok and admitted and hit is not None and hit.num_tokens:
            self.finished.continue_best(self._tokens.get(request_id, []))
        return ok

    def free(self, request_id: str) -> None:
        super().free(request_id)  # type: ignore[misc]
        tokens = self._tokens.pop(request_id, None)
        if tokens:
            self.finished.add(tokens)


class FinishedScopeKVCache(FinishedScope, KVCacheManager):
    """The fast cache that only finished requests feed."""


class PlainFinishedScopeKVCache(FinishedScope, PlainKVCache):
    """The plain cache that only finished requests feed (what the fast one must equal)."""
