"""The KV cache the engine runs: ``kv_cache_plain.PlainKVCache``'s policy, made fast.

``KVCacheManager`` does exactly what ``PlainKVCache`` does, call for call: the same block
tables, hits, counts, evictions and hand-out order (tests/test_kv_cache.py compares them
block for block under random operations). Read the plain one for the policy and the
contract; this module adds only how it is made cheap, because the simulator calls it for
every sequence of every step (docs/design/kv_cache.md, "Cost").

Per-block state lives in lists indexed by block id, and the hand-out queue is two parts: the
free blocks as a stack (its end handed out first) and the cached blocks in a
``kv_cached_queue.CachedQueue``, whose removal from the middle (a prefix hit) is O(1). The
cache maps a registered block's chain hash, an int, to the block, so no token tuple is hashed
again at a registration, lookup or eviction; a request's chain hashes and token tuples
(``kv_block_chain``) are memoised.

Deferred hashing: a lookup can only reach a block through the block 0 of its chain (the
*root*), so a request whose root starts no registered block's chain (keyed blocks are
counted per root) is registered without hashing: its blocks are marked as registered by a
*deferred group* kept under its root hash, with a copy of their tokens. Everything that
depends on registration (hand-out order, evictions, ``num_cached_blocks``) is as if they
were in the map. The first lookup or registration that comes with the same root puts the
group's surviving blocks into the map, in the order they were registered, before it goes
on, so hits and which copy of shared content is kept are those of registering at once. In a
replay of unique prompts almost no block is hashed. (Two different prefixes whose chain
hashes collide, about 2**-64 per pair, may keep another copy than eager registration would;
either way a hit is confirmed against the tokens.)
"""

from __future__ import annotations

from servelab.engine.kv.block_chain import Chain, DeferredGroup, extend_chain
from servelab.engine.kv.cached_queue import CachedQueue
from servelab.engine.kv.kv_cache_plain import ROOT_HASH, BlockKey, KVCacheBase, PrefixHit


class KVCacheManager(KVCacheBase):
    """``PlainKVCache``'s interface and behaviour (its docstrings are the contract), fast."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        # Per block, indexed by id (lists: a replay hands out, registers and frees millions
        # of blocks, and a list slot is cheaper than an object's attribute or a dict entry);
        # the reference counts ``_refs`` (KVCacheBase) too.
        # The registration: None, the key (in ``_cached`` under ``_hash``) or a DeferredGroup.
        self._key: list[BlockKey | DeferredGroup | None] = [None] * num_blocks
        self._hash = [0] * num_blocks
        self._root_of = [0] * num_blocks  # root hash of a keyed block's chain
        # The eviction queue in two parts. Free blocks: a stack, its end handed out first.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._lru = CachedQueue(num_blocks)  # then the cached ones, least recently freed first
        self._cached: dict[int, int] = {}  # chain hash -> block id
        self._root_count: dict[int, int] = {}  # root hash -> keyed blocks of chains from it
        self._deferred: dict[int, DeferredGroup] = {}  # root hash -> its group
        self._num_deferred = 0  # blocks registered in deferred groups
        # Per request, the chain hashes of its full blocks so far and their token tuples
        # (keys[i] == (hashes[i - 1] or the root's parent, tokens[i])).
        self._chains: dict[str, Chain] = {}
        self._groups: dict[str, DeferredGroup] = {}  # live requests registering deferred
        self._num_registered: dict[str, int] = {}  # leading blocks of the table already cached

    # ---- state ----

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or cached-and-evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_blocks - len(self._free) - len(self._lru)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or evictable)."""
        return len(self._cached) + self._num_deferred

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (vLLM's kv_cache_usage_perc)."""
        return self.num_used_blocks / self.num_blocks

    # ---- prefix cache ----

    def _chain(self, request_id: str, token_ids: list[int], num_blocks: int) -> Chain:
        """Chain hashes and token tuples of (at least) the first ``num_blocks`` full blocks,
        memoised per request: each block's tuple is built and hashed once."""
        chain = self._chains.get(request_id)
        if chain is None:
            chain = self._chains[request_id] = ([], [])
        if num_blocks > len(chain[0]):
            extend_chain(chain, token_ids, num_blocks, self.block_size)
        return chain

    def chain_hashes(self, request_id: str, token_ids: list[int], num_blocks: int) -> list[int]:
        """Chain hashes of the first ``num_blocks`` full blocks, memoised per request: what the
        cache registers them under, so two engines that agree on them hold the same tokens."""
        return self._chain(request_id, token_ids, num_blocks)[0]

    def lookup(self, request_id: str, token_ids: list[int]) -> PrefixHit:
        """Cached blocks for the start of ``token_ids`` (see the module contract)."""
        if not self.enable_prefix_caching or not token_ids:
            return PrefixHit()
        max_blocks = (len(token_ids) - 1) // self.block_size
        if not max_blocks:
            return PrefixHit(num_queried_tokens=len(token_ids))
        root = self._chain(request_id, token_ids, 1)[0][0]
        group = self._deferred.get(root)
        if group is not None:
            self._undefer(group)
        cached = self._cached
        # Nothing shares the first block (a unique prompt): no need to hash the rest.
        if root not in cached:
            return PrefixHit(num_queried_tokens=len(token_ids))
        hashes, tokens = self._chain(request_id, token_ids, max_blocks)
        keys = self._key
        blocks: list[int] = []
        parent = ROOT_HASH
        for i in range(max_blocks):
            h = hashes[i]
            block_id = cached.get(h)
            if block_id is None or keys[block_id] != (parent, tokens[i]):
                break
            blocks.append(block_id)
            parent = h
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
        # The table's blocks from ``start`` on were handed out to this request alone and are
        # registered nowhere yet.
        self._num_registered[request_id] = num_full
        group = self._groups.get(request_id)
        if group is None:
            root = self._chain(request_id, token_ids, 1)[0][0]
            other = self._deferred.get(root)
            if other is not None:
                self._undefer(other)
            elif not start and root not in self._root_count:
                # No registered block's chain starts at this root: defer the hashing.
                group = self._groups[request_id] = self._deferred[root] = DeferredGroup(
                    request_id, root, table
                )
        if group is None:
            self._register(table, start, num_full, self._chain(request_id, token_ids, num_full))
            return
        bs = self.block_size
        group.tokens += token_ids[start * bs : num_full * bs]
        group.num_blocks = num_full
        group.alive += num_full - start
        self._num_deferred += num_full - start
        keys = self._key
        for i in range(start, num_full):
            keys[table[i]] = group

    def _register(
        self,
        table: list[int],
        start: int,
        end: int,
        chain: Chain,
        deferred: DeferredGroup | None = None,
    ) -> None:
        """Key ``table[start:end]`` in the map: each block unless another holds its hash (the
        same content, registered first, is kept). With ``deferred``, only the blocks still
        registered by that group."""
        hashes, tokens = chain
        root = hashes[0]
        cached, keys, block_hash, roots_of = self._cached, self._key, self._hash, self._root_of
        parent = hashes[start - 1] if start else ROOT_HASH
        added = 0
        for i in range(start, end):
            b = table[i]
            h = hashes[i]
            if (deferred is None or keys[b] is deferred) and cached.setdefault(h, b) == b:
                keys[b] = (parent, tokens[i])
                block_hash[b] = h
                roots_of[b] = root
                added += 1
            elif deferred is not None and keys[b] is deferred:
                keys[b] = None  # only on a chain-hash collision; see the module docstring
                self._requeue_unregistered(b)
            parent = h
        if added:
            self._root_count[root] = self._root_count.get(root, 0) + added

    def _undefer(self, group: DeferredGroup) -> None:
        """Move a deferred group's surviving blocks into the map (hashing them now)."""
        del self._deferred[group.root]
        chain: Chain = ([], [])
        extend_chain(chain, group.tokens, group.num_blocks, self.block_size)
        self._num_deferred -= group.alive
        group.alive = 0
        self._register(group.table, 0, group.num_blocks, chain, group)
        rid = group.request_id
        if self._groups.get(rid) is group:
            # The request registers its next blocks at once, from this chain on.
            del self._groups[rid]
            self._chains[rid] = chain

    def _requeue_unregistered(self, b: int) -> None:
        """A block that lost its registration while queued as cached is queued as free."""
        if self._refs[b] == 0:
            self._lru.remove(b)
            self._free.append(b)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (blocks in use stay allocated). Always succeeds."""
        self._key = [None] * self.num_blocks
        self._cached.clear()
        self._root_count.clear()
        self._deferred.clear()
        self._groups.clear()
        self._num_deferred = 0
        # The cached blocks nobody holds become free ones, handed out after the free ones
        # in the order they were queued in.
        self._free[:0] = reversed(self._lru.take(len(self._lru)))
        # Live requests' blocks are not re-registered later: a caller resets because cached K/V
        # may be stale (e.g. new weights), and theirs predates the reset.
        for request_id, table in self._tables.items():
            self._num_registered[request_id] = len(table)
        return True

    # ---- allocation ----

    def allocate(self, request_id: str, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Grow the request's block table to cover ``num_tokens`` (all or nothing)."""
        table = self._tables.get(request_id)
        if table is not None:  # growing: a decode or a later chunk
            need_new = -(-num_tokens // self.block_size) - len(table)
            # Most decode steps stay inside the last block: nothing changes.
            if need_new <= 0:
                return True
            if need_new > len(self._free) + len(self._lru):
                return False
            table += self._take_blocks(need_new)
            return True
        prefix = hit.blocks if hit is not None else []
        need_new = max(0, self.blocks_needed(num_tokens) - len(prefix))
        refs = self._refs
        # Hit blocks nobody references are still in the evictable queue; taking them shrinks it.
        revived = sum(1 for b in prefix if not refs[b]) if prefix else 0
        if need_new + revived > len(self._free) + len(self._lru):
            return False
        table = self._tables[request_id] = []
        self._num_registered[request_id] = len(prefix)
        if hit is not None and hit.num_queried_tokens:
            self.prefix_cache_queries += hit.num_queried_tokens
            self.prefix_cache_hits += hit.num_tokens
        # Reference the hit blocks before handing out new ones, so none of them gets evicted.
        for b in prefix:
            if not refs[b]:
                self._lru.remove(b)
            refs[b] += 1
        table += prefix
        if need_new:
            table += self._take_blocks(need_new)
        return True

    def _take_blocks(self, n: int) -> list[int]:
        """Hand out ``n`` blocks from the front of the queue, evicting cached ones."""
        free = self._free
        k = min(n, len(free))
        taken: list[int] = []
        if k:
            taken = free[-k:]
            taken.reverse()  # the stack's top first
            del free[-k:]
        if n > k:
            taken += self._evict(n - k)
        refs = self._refs
        for b in taken:
            refs[b] = 1
        return taken

    def _evict(self, n: int) -> list[int]:
        """Take the ``n`` least recently freed cached blocks out of the queue and the cache."""
        out = self._lru.take(n)
        keys, cached, block_hash, roots_of, roots = (
            self._key,
            self._cached,
            self._hash,
            self._root_of,
            self._root_count,
        )
        deferred = 0
        for b in out:
            key = keys[b]
            keys[b] = None
            if type(key) is DeferredGroup:
                deferred += 1
                key.alive -= 1
                if not key.alive and self._deferred.get(key.root) is key:
                    del self._deferred[key.root]
            else:
                del cached[block_hash[b]]
                root = roots_of[b]
                left = roots[root] - 1
                if left:
                    roots[root] = left
                else:
                    del roots[root]
        self._num_deferred -= deferred
        self.evictions += n
        return out

    def free(self, request_id: str) -> None:
        """Drop the request's references and forget it (see the module contract)."""
        table = self._tables.pop(request_id, None)
        self._chains.pop(request_id, None)
        self._groups.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        if not table:
            return
        refs, keys, free = self._refs, self._key, self._free
        cached: list[int] = []
        # Tail blocks are the least likely to be shared, so they are freed (and evicted) first.
        for b in reversed(table):
            left = refs[b] - 1
            refs[b] = left
            if not left:
                if keys[b] is None:
                    free.append(b)  # holds nothing reusable: handed out before any cached block
                else:
                    cached.append(b)
        if cached:
            self._lru.extend(cached)

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Free the request's blocks past the first ``blocks_needed(num_tokens)``, as ``free``
        frees blocks; return how many (see ``PlainKVCache.trim``)."""
        table = self._tables.get(request_id)
        keep = self.blocks_needed(num_tokens)
        if table is None or len(table) <= keep:
            return 0
        tail = table[keep:]
        del table[keep:]
        # Released through free() under a throw-away id, so each block is returned exactly as
        # free() returns blocks (reference counts, hand-out order).
        tail_id = f"{request_id}\x00rolled-back"
        self._tables[tail_id] = tail
        self.free(tail_id)
        return len(tail)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        refs = [0] * self.num_blocks
        for table in self._tables.values():
            for b in table:
                refs[b] += 1
        assert refs == self._refs, "refcounts"
        lru = self._lru.blocks()
        queued = [*self._free, *lru]
        assert len(queued) == len(set(queued)), "a block queued twice"
        idle = {b for b in range(self.num_blocks) if not self._refs[b]}
        assert set(queued) == idle, "evictable state"
        assert all(self._key[b] is None for b in self._free), "a free block is registered"
        assert all(self._key[b] is not None for b in lru), "an unregistered block in the LRU"
        keyed = [b for b in range(self.num_blocks) if isinstance(self._key[b], tuple)]
        for b in keyed:
            assert self._hash[b] == hash(self._key[b]), f"block {b} hash"
            assert self._cached.get(self._hash[b]) == b, "cache map mismatch"
        assert len(self._cached) == len(keyed)
        roots: dict[int, int] = {}
        for b in keyed:
            roots[self._root_of[b]] = roots.get(self._root_of[b], 0) + 1
        assert roots == self._root_count, "root counts"
        deferred = [k for k in self._key if isinstance(k, DeferredGroup)]
        assert len(deferred) == self._num_deferred, "deferred count"
        for group in set(deferred):
            assert deferred.count(group) == group.alive, "deferred group size"
            assert self._deferred.get(group.root) is group, "deferred group not indexed"
            assert group.root not in self._root_count, "deferred root also keyed"
