"""The KV cache's policy, stated plainly: paged blocks, reference counts and a prefix cache.

``PlainKVCache`` is written to be read, and its docstrings are the contract. The engine runs
``kv_cache.KVCacheManager`` by default: the same policy call for call, made fast
(tests/test_kv_cache.py compares them block for block); ``EngineConfig(kv_cache="plain")``
runs it on this one. The executor owns the memory; a KV cache decides which block ids hold
what. docs/design/kv_cache.md has the reasoning.

A block is *in use* (in a request's block table: ``ref_count > 0``), *cached* (in none, but
registered in the prefix cache) or *free*. Idle blocks wait in one hand-out queue: free ones
in front, the most recently freed first, then cached ones, the least recently freed first;
handing out a cached block evicts it. Block i of a sequence is registered under the key
(chain hash of block i-1, block i's tokens), whose hash is the block's chain hash; a hit is
confirmed against the key, so a hash collision costs a miss, never a wrong hit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from servelab.engine.kv.kv_cache import KVCacheManager

KVCache: TypeAlias = "PlainKVCache | KVCacheManager"  # the same policy, either speed
BlockKey = tuple[int, tuple[int, ...]]  # (parent chain hash, the block's token ids)
ROOT_HASH = 0x5E12_7E1A  # the parent chain hash of a sequence's first block


class KVCacheBase:
    """What both KV caches hold alike: ``num_blocks`` blocks of ``block_size`` tokens, the
    prefix cache on or off, a reference count per block id, each request's block table and
    the prefix-cache counters. ValueError unless the pool has at least one block of at
    least one token."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"the KV cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, "
                f"{block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refs = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self.prefix_cache_queries = 0  # tokens looked up by successful admissions
        self.prefix_cache_hits = 0  # of those, tokens found cached
        self.evictions = 0

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids in position order (empty if none); the cache's own list:
        read it, never change or keep it."""
        return self._tables.get(request_id, [])

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


@dataclass
class PrefixHit:
    """Cached blocks found for the start of a token sequence."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0  # cached tokens (len(blocks) * block_size)
    num_queried_tokens: int = 0  # tokens looked up (the prefix-cache query, vLLM's meaning)


class PlainKVCache(KVCacheBase):
    """The policy in the module docstring, one list per state (each hand-out is O(blocks))."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self._key: list[BlockKey | None] = [None] * num_blocks  # set while registered
        self._queue = list(range(num_blocks))  # the hand-out queue, front first
        self._cached: dict[int, int] = {}  # chain hash -> block
        self._registered: dict[str, int] = {}  # leading blocks of a table already registered

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or cached)."""
        return len(self._queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, in use or not."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (vLLM's kv_cache_usage_perc)."""
        return self.num_used_blocks / self.num_blocks

    def chain_hashes(self, request_id: str, token_ids: list[int], num_blocks: int) -> list[int]:
        """The chain hashes of the first ``num_blocks`` full blocks of ``token_ids``: what the
        prefix cache registers them under (the same in every process of one Python build)."""
        return [hash(key) for key in self._keys(token_ids, num_blocks)]

    def _keys(self, token_ids: list[int], num_blocks: int) -> list[BlockKey]:
        keys: list[BlockKey] = []
        parent, bs = ROOT_HASH, self.block_size
        for i in range(num_blocks):
            keys.append((parent, tuple(token_ids[i * bs : (i + 1) * bs])))
            parent = hash(keys[-1])
        return keys

    def lookup(self, request_id: str, token_ids: list[int]) -> PrefixHit:
        """The longest run of cached blocks at the start of ``token_ids``, at most
        ``(len(token_ids) - 1) // block_size`` of them: the last token is always computed,
        since its logits are sampled. Takes no reference and changes nothing."""
        if not self.enable_prefix_caching or not token_ids:
            return PrefixHit()
        blocks = []
        for key in self._keys(token_ids, (len(token_ids) - 1) // self.block_size):
            b = self._cached.get(hash(key))
            if b is None or self._key[b] != key:
                break
            blocks.append(b)
        return PrefixHit(blocks, len(blocks) * self.block_size, len(token_ids))

    def allocate(self, request_id: str, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Grow the request's block table to cover ``num_tokens`` from the front of the queue.
        On its first allocation ``hit``'s blocks come first, referenced before any block is
        handed out (so none of them is evicted), and the hit is counted. All or nothing:
        False, and no change, when the queue is too short."""
        table = self._tables.get(request_id)
        prefix = hit.blocks if hit is not None and table is None else []
        need = max(0, self.blocks_needed(num_tokens) - len(table if table is not None else prefix))
        revived = sum(1 for b in prefix if self._refs[b] == 0)  # hit blocks still queued
        if need + revived > len(self._queue):
            return False
        if table is None:
            table = self._tables[request_id] = []
            self._registered[request_id] = len(prefix)
            if hit is not None:
                self.prefix_cache_queries += hit.num_queried_tokens
                self.prefix_cache_hits += hit.num_tokens
        for b in prefix:
            if self._refs[b] == 0:
                self._queue.remove(b)
            self._refs[b] += 1
            table.append(b)
        for _ in range(need):
            b = self._queue.pop(0)
            key = self._key[b]
            if key is not None:
                del self._cached[hash(key)]
                self._key[b] = None
                self.evictions += 1
            self._refs[b] = 1
            table.append(b)
        return True

    def cache_blocks(self, request_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """Register the request's full blocks among its first ``num_computed_tokens`` tokens;
        call after the step that computed them."""
        table = self._tables.get(request_id)
        if not self.enable_prefix_caching or table is None:
            return
        start = self._registered[request_id]
        end = min(num_computed_tokens // self.block_size, len(table))
        for i, key in enumerate(self._keys(token_ids, end)[start:], start):
            if self._cached.setdefault(hash(key), table[i]) == table[i]:
                self._key[table[i]] = key
        self._registered[request_id] = max(start, end)

    def free(self, request_id: str) -> None:
        """Drop the request's references and forget it. Safe for a request that holds none."""
        self._release(self._tables.pop(request_id, []))
        self._registered.pop(request_id, None)

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Free, as ``free`` does, the request's blocks past the first
        ``blocks_needed(num_tokens)`` (they hold only rejected speculative drafts, never a
        verified position); return how many."""
        keep = self.blocks_needed(num_tokens)
        table = self._tables.get(request_id, [])
        tail = table[keep:]
        del table[keep:]
        self._release(tail)
        return len(tail)

    def _release(self, blocks: list[int]) -> None:
        """Unreference ``blocks`` tail first; one nobody holds is queued, in front if it holds
        nothing reusable, at the back if it is cached."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self._key[b] is None:
                    self._queue.insert(0, b)
                else:
                    self._queue.append(b)

    def reset_prefix_cache(self) -> bool:
        """Unregister every block. Blocks in use stay allocated but are never registered: a
        caller resets because cached K/V may be stale (new weights). Always True."""
        self._key = [None] * self.num_blocks
        self._cached.clear()
        for request_id, table in self._tables.items():
            self._registered[request_id] = len(table)
        return True

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests call it)."""
        refs = [0] * self.num_blocks
        for b in (b for table in self._tables.values() for b in table):
            refs[b] += 1
        assert refs == self._refs, "reference counts"
        assert sorted(self._queue) == [b for b, n in enumerate(refs) if not n], "the queue"
        keyed = {hash(key): b for b, key in enumerate(self._key) if key is not None}
        assert self._cached == keyed, "the cache map"
