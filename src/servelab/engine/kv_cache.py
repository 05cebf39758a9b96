"""Paged KV-cache bookkeeping with prefix caching. Pure Python: no torch (the simulator reuses it).

The executor owns the memory; this module only decides which block ids hold what.

Block states: a block is *in use* (ref_count > 0: in at least one request's block table),
*cached* (ref_count 0, registered in the prefix cache, evictable), or *free* (ref_count 0,
holds nothing reusable). Cached and free blocks together form the eviction queue: plain free
blocks are handed out first, then cached ones, least recently freed first (LRU); handing out
a cached block evicts it from the prefix cache.

Prefix caching: block i of a token sequence is identified by the chained key
``(hash of block i-1's key, tuple of block i's token ids)``. The cache maps each registered
block's chain hash (the hash of its key) to the block, and a lookup confirms a hit against
the key the block holds, so a hit is checked against the tokens, not just a hash (a hash
collision costs a miss, never a wrong hit). Keying by the hash, an int, spares hashing the
token tuple again at every registration, lookup and eviction. Only full blocks whose K/V
has been computed are registered.

Contract (the interface the scheduler relies on):
- ``lookup(request_id, token_ids) -> PrefixHit``: the longest run of cached full blocks at
  the start of ``token_ids``, capped so that at least the last token is computed (at most
  ``(len(token_ids) - 1) // block_size`` blocks). Takes no references, changes nothing.
- ``allocate(request_id, num_tokens, hit=None) -> bool``: make the request's block table
  cover ``num_tokens`` tokens; on the request's first allocation ``hit``'s blocks come
  first. All or nothing: False (and no change) when too few blocks are available.
- ``cache_blocks(request_id, token_ids, num_computed_tokens)``: register the request's full
  blocks whose K/V is now computed. Call after the step that computed them.
- ``free(request_id)``: drop the request's references (its blocks become cached or free) and
  forget it. Safe for a request that holds nothing.
- Invariant: when no request holds blocks, every block has ref_count 0.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

BlockKey = tuple[int, tuple[int, ...]]  # (parent chain hash, the block's token ids)
_ROOT_HASH = 0x5E12_7E1A  # parent hash of a sequence's first block


@dataclass
class PrefixHit:
    """Cached blocks found for the start of a token sequence."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0  # cached tokens (len(blocks) * block_size)
    num_queried_tokens: int = 0  # tokens looked up (the prefix-cache query, vLLM's meaning)


class _Block:
    __slots__ = ("block_id", "hash", "key", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.key: BlockKey | None = None  # set while registered in the prefix cache
        self.hash = 0  # hash(key) while registered: its entry in the cache


class KVCacheManager:
    """Fixed-size KV blocks, per-request block tables, reference counts and a prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"the KV cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, "
                f"{block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # ref_count == 0 blocks in hand-out order (front first); values unused.
        self._evictable: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # chain hash -> block id
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[int]] = {}  # chain hashes of a request's full blocks
        self._keys: dict[str, list[BlockKey]] = {}  # and their keys (hashes[i] == hash(keys[i]))
        self._num_registered: dict[str, int] = {}  # leading blocks of the table already cached
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.evictions = 0

    # ---- state ----

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or cached-and-evictable)."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_blocks - len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or evictable)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (vLLM's kv_cache_usage_perc)."""
        return self.num_used_blocks / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids in position order (empty if it holds none). Do not mutate."""
        return self._tables.get(request_id, [])

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ----

    def _chain(
        self, request_id: str, token_ids: list[int], num_blocks: int
    ) -> tuple[list[BlockKey], list[int]]:
        """Keys and chain hashes of (at least) the first ``num_blocks`` full blocks, memoised
        per request: each block's token tuple is built once, not at every lookup."""
        keys = self._keys.setdefault(request_id, [])
        hashes = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        parent = hashes[-1] if hashes else _ROOT_HASH
        first = len(hashes)
        # One tuple of the new blocks' tokens, sliced per block: a slice of a tuple is a
        # tuple, so each block's is built once rather than as a list and then a tuple.
        tokens = tuple(token_ids[first * bs : num_blocks * bs])
        for off in range(0, (num_blocks - first) * bs, bs):
            key = (parent, tokens[off : off + bs])
            parent = hash(key)
            keys.append(key)
            hashes.append(parent)
        return keys, hashes

    def chain_hashes(self, request_id: str, token_ids: list[int], num_blocks: int) -> list[int]:
        """Chain hashes of the first ``num_blocks`` full blocks, memoised per request: what the
        cache registers them under, so two engines that agree on them hold the same tokens."""
        return self._chain(request_id, token_ids, num_blocks)[1]

    def lookup(self, request_id: str, token_ids: list[int]) -> PrefixHit:
        """Cached blocks for the start of ``token_ids`` (see the module contract)."""
        if not self.enable_prefix_caching or not token_ids:
            return PrefixHit()
        max_blocks = (len(token_ids) - 1) // self.block_size
        keys, hashes = self._chain(request_id, token_ids, max_blocks)
        cached, all_blocks = self._cached, self._blocks
        blocks: list[int] = []
        for i in range(max_blocks):
            block_id = cached.get(hashes[i])
            if block_id is None or all_blocks[block_id].key != keys[i]:
                break
            blocks.append(block_id)
        return PrefixHit(blocks, len(blocks) * self.block_size, len(token_ids))

    def cache_blocks(self, request_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """Register the request's full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = num_computed_tokens // self.block_size
        start = self._num_registered.get(request_id, 0)
        # Most calls (a decode step inside a block) register nothing: answer before any work.
        if num_full <= start:
            return
        table = self._tables.get(request_id)
        if table is None:
            return
        num_full = min(num_full, len(table))
        if num_full <= start:
            return
        keys, hashes = self._chain(request_id, token_ids, num_full)
        blocks, cached = self._blocks, self._cached
        for i in range(start, num_full):
            block = blocks[table[i]]
            # Another request may have computed the same content first: keep that copy.
            # (no hash maps to a block whose key is None.)
            if block.key is None:
                h = hashes[i]
                if cached.setdefault(h, block.block_id) == block.block_id:
                    block.key, block.hash = keys[i], h
        self._num_registered[request_id] = num_full

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (blocks in use stay allocated). Always succeeds."""
        for block in self._blocks:
            block.key = None
        self._cached.clear()
        # Live requests' blocks are not re-registered later: a caller resets because cached K/V
        # may be stale (e.g. new weights), and theirs predates the reset.
        for request_id, table in self._tables.items():
            self._num_registered[request_id] = len(table)
        return True

    # ---- allocation ----

    def allocate(self, request_id: str, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Grow the request's block table to cover ``num_tokens`` (all or nothing)."""
        table = self._tables.get(request_id)
        # Fast path: the table already covers the tokens (most decode steps), so nothing changes.
        if table is not None and num_tokens <= len(table) * self.block_size:
            return True
        prefix = hit.blocks if (hit is not None and table is None) else []
        have = len(prefix) if table is None else len(table)
        need_new = max(0, self.blocks_needed(num_tokens) - have)
        # Hit blocks nobody references are still in the evictable queue; taking them shrinks it.
        revived = sum(1 for b in prefix if self._blocks[b].ref_count == 0)
        if need_new + revived > len(self._evictable):
            return False
        if table is None:
            table = self._tables[request_id] = []
            self._num_registered[request_id] = len(prefix)
            if hit is not None and hit.num_queried_tokens:
                self.prefix_cache_queries += hit.num_queried_tokens
                self.prefix_cache_hits += hit.num_tokens
        # Reference the hit blocks before handing out new ones, so none of them gets evicted.
        for b in prefix:
            self._ref(b)
            table.append(b)
        table += self._take_blocks(need_new)
        return True

    def _ref(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
        block.ref_count += 1

    def _take_blocks(self, n: int) -> list[int]:
        """Hand out ``n`` blocks from the front of the queue, evicting cached ones."""
        evictable, blocks, cached = self._evictable, self._blocks, self._cached
        taken = []
        evicted = 0
        for _ in range(n):
            block_id, _ = evictable.popitem(last=False)
            block = blocks[block_id]
            if block.key is not None:
                del cached[block.hash]
                block.key = None
                evicted += 1
            block.ref_count = 1
            taken.append(block_id)
        self.evictions += evicted
        return taken

    def free(self, request_id: str) -> None:
        """Drop the request's references and forget it (see the module contract)."""
        table = self._tables.pop(request_id, [])
        self._hashes.pop(request_id, None)
        self._keys.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        evictable, blocks = self._evictable, self._blocks
        # Tail blocks are the least likely to be shared, so they are freed (and evicted) first.
        for block_id in reversed(table):
            block = blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                evictable[block_id] = None
                if block.key is None:
                    # Holds nothing reusable: hand it out before any cached block.
                    evictable.move_to_end(block_id, last=False)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        refs = [0] * self.num_blocks
        for table in self._tables.values():
            for b in table:
                refs[b] += 1
        for block in self._blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id} refcount"
            assert (block.ref_count == 0) == (block.block_id in self._evictable), (
                f"block {block.block_id} evictable state"
            )
            if block.key is not None:
                assert block.hash == hash(block.key), f"block {block.block_id} hash"
                assert self._cached.get(block.hash) == block.block_id, "cache map mismatch"
        assert len(self._cached) == sum(b.key is not None for b in self._blocks)
