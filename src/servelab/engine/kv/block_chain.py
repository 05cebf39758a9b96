"""Block chains for the fast KV cache: a sequence's full blocks, each hashed with its parent's
chain hash, and the deferred groups that register a chain's blocks before hashing them
(``kv_cache.py`` says when and why)."""

from __future__ import annotations

from itertools import repeat

from servelab.engine.kv.kv_cache_plain import ROOT_HASH

# A chain: the chain hashes of a sequence's first full blocks and their token tuples
# (block i's key is (hashes[i - 1] or ROOT_HASH, tokens[i]), and hashes[i] its hash).
Chain = tuple[list[int], list[tuple[int, ...]]]


class DeferredGroup:
    """Blocks registered without hashing: the first ``num_blocks`` of ``table``, holding
    ``tokens``; ``alive`` of them are still registered (not evicted since)."""

    __slots__ = ("alive", "num_blocks", "request_id", "root", "table", "tokens")

    def __init__(self, request_id: str, root: int, table: list[int]) -> None:
        self.request_id = request_id
        self.root = root
        self.table = table  # the request's table; its registered positions never change
        self.tokens: list[int] = []
        self.num_blocks = 0
        self.alive = 0


def extend_chain(chain: Chain, token_ids: list[int], num_blocks: int, bs: int) -> None:
    """Extend ``chain`` to ``num_blocks`` full blocks of ``token_ids`` (``bs`` tokens each)."""
    hashes, tokens = chain
    first = len(hashes)
    # zip over one iterator repeated ``bs`` times cuts the tokens into block tuples in C.
    it = iter(token_ids[first * bs : num_blocks * bs])
    new = list(zip(*repeat(it, bs), strict=False))
    h = hashes[-1] if hashes else ROOT_HASH
    hashes += [h := hash((h, t)) for t in new]
    tokens += new
