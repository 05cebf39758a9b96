"""KVCacheManager: block accounting, prefix caching, LRU eviction, invariants; and that it
behaves exactly like PlainKVCache, the policy written plainly."""

from __future__ import annotations

import random

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from servelab.engine.kv import block_chain as kv_block_chain
from servelab.engine.kv import kv_cache
from servelab.engine.kv.finished_scope import FinishedScopeKVCache, PlainFinishedScopeKVCache
from servelab.engine.kv.kv_cache import KVCacheManager
from servelab.engine.kv.kv_cache_plain import PlainKVCache

BS = 4


def kv(num_blocks: int = 8, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_prefix_caching=caching)


def run_prefill(m: KVCacheManager, rid: str, tokens: list[int]) -> int:
    """Look up, allocate the whole sequence, mark it computed; return cached tokens."""
    hit = m.lookup(rid, tokens)
    assert m.allocate(rid, len(tokens), hit)
    m.cache_blocks(rid, tokens, len(tokens))
    return hit.num_tokens


def test_allocate_grows_table_and_free_returns_blocks() -> None:
    m = kv(8)
    assert m.allocate("a", 5)
    assert len(m.block_table("a")) == 2
    assert m.allocate("a", 8)  # still two blocks
    assert len(m.block_table("a")) == 2
    assert m.allocate("a", 9)
    assert len(m.block_table("a")) == 3
    assert m.num_used_blocks == 3 and m.usage == 3 / 8
    m.free("a")
    assert m.num_used_blocks == 0 and m.block_table("a") == []
    m.check_invariants()


def test_allocation_is_all_or_nothing() -> None:
    m = kv(4)
    assert m.allocate("a", 12)  # 3 blocks
    assert not m.allocate("b", 8)  # needs 2, only 1 left
    assert m.block_table("b") == [] and m.num_free_blocks == 1
    assert not m.allocate("a", 20)  # would need 2 more
    assert len(m.block_table("a")) == 3
    m.check_invariants()


def test_prefix_hit_reuses_blocks_and_counts_tokens() -> None:
    m = kv(16)
    prompt = list(range(10, 22))  # 12 tokens = 3 full blocks
    assert run_prefill(m, "a", prompt) == 0
    other = prompt[:8] + [99, 98, 97, 96, 95]
    hit = m.lookup("b", other)
    assert hit.num_tokens == 8
    assert hit.blocks == m.block_table("a")[:2]
    assert m.allocate("b", len(other), hit)
    assert m.block_table("b")[:2] == m.block_table("a")[:2]
    assert m.ref_count(m.block_table("a")[0]) == 2
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (12 + 13, 8)
    m.check_invariants()


def test_hit_is_capped_so_the_last_token_is_computed() -> None:
    m = kv(16)
    prompt = list(range(8))  # exactly two blocks
    run_prefill(m, "a", prompt)
    assert m.lookup("b", prompt).num_tokens == 4  # not 8: the last token must be computed
    assert m.lookup("c", prompt + [100]).num_tokens == 8


def test_chained_hash_needs_the_same_prefix() -> None:
    m = kv(16)
    run_prefill(m, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # Same second block, different first block: no hit at all.
    assert m.lookup("b", [9, 9, 9, 9, 5, 6, 7, 8, 9]).num_tokens == 0
    # Differs inside block 2: only block 1 hits.
    assert m.lookup("c", [1, 2, 3, 4, 5, 6, 0, 8, 9]).num_tokens == 4


def test_only_full_computed_blocks_are_cached() -> None:
    m = kv(16)
    tokens = list(range(30, 41))  # 11 tokens
    assert m.allocate("a", len(tokens))
    m.cache_blocks("a", tokens, 6)  # only block 0 is full and computed
    assert m.num_cached_blocks == 1
    m.cache_blocks("a", tokens, 11)  # blocks 0, 1 full; block 2 partial
    assert m.num_cached_blocks == 2
    assert m.lookup("b", tokens + [1, 2]).num_tokens == 8


def test_disabled_prefix_caching_never_hits() -> None:
    m = kv(16, caching=False)
    run_prefill(m, "a", list(range(12)))
    m.free("a")
    assert m.lookup("b", list(range(13))).num_tokens == 0
    assert m.num_cached_blocks == 0 and m.prefix_cache_queries == 0


def test_freed_blocks_stay_cached_until_evicted_lru() -> None:
    m = kv(4)
    a, b = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    run_prefill(m, "a", a)  # 2 blocks, block 0 cached
    run_prefill(m, "b", b)
    m.free("a")
    m.free("b")  # freed later: survives longer
    assert m.num_used_blocks == 0
    assert m.lookup("a2", a + [0]).num_tokens == 4
    # Two uncached blocks are free, so this takes them and evicts nothing.
    assert m.allocate("c", 8)
    assert m.evictions == 0
    # One more block must evict a cached one: a's (freed first), not b's.
    assert m.allocate("d", 4)
    assert m.evictions == 1
    assert m.lookup("a3", a + [0]).num_tokens == 0
    assert m.lookup("b3", b + [0]).num_tokens == 4
    m.check_invariants()


def test_hit_blocks_are_not_evicted_by_their_own_allocation() -> None:
    m = kv(4)
    a, c = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]
    run_prefill(m, "a", a)
    run_prefill(m, "c", c)
    m.free("a")  # a's blocks are now the least recently freed: first in line for eviction
    m.free("c")
    hit = m.lookup("b", a + [0])
    assert hit.num_tokens == 8
    assert m.allocate("b", 9, hit)  # 2 revived + 1 new: the new one must not be a's
    table = m.block_table("b")
    assert table[:2] == hit.blocks and len(set(table)) == 3
    assert m.evictions == 1
    assert m.lookup("c2", c + [0]).num_tokens == 4  # c lost only its tail block
    m.check_invariants()


def test_hit_needing_more_than_available_fails_cleanly() -> None:
    m = kv(3)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    run_prefill(m, "a", prompt)
    m.free("a")
    hit = m.lookup("b", prompt + [9, 10, 11, 12, 13])
    assert not m.allocate("b", 13, hit)  # 2 revived + 2 new > 3
    assert m.block_table("b") == [] and m.num_used_blocks == 0
    assert m.num_cached_blocks == 2
    assert m.prefix_cache_hits == 0  # a failed admission is not counted
    m.check_invariants()


def test_same_content_computed_twice_keeps_one_cached_copy() -> None:
    m = kv(8)
    p = [5, 6, 7, 8, 9]
    for rid in ("a", "b"):  # both admitted before either cached anything
        assert m.allocate(rid, len(p))
    m.cache_blocks("a", p, 5)
    m.cache_blocks("b", p, 5)
    assert m.num_cached_blocks == 1
    m.free("a")
    m.free("b")
    m.check_invariants()
    assert m.lookup("c", p).num_tokens == 4


def test_reset_prefix_cache_forgets_everything() -> None:
    m = kv(8)
    run_prefill(m, "a", list(range(9)))
    run_prefill(m, "b", list(range(100, 109)))
    m.free("a")
    assert m.reset_prefix_cache()
    assert m.num_cached_blocks == 0
    assert m.lookup("c", list(range(9))).num_tokens == 0
    m.cache_blocks("b", list(range(100, 109)), 9)  # b's pre-reset blocks stay forgotten
    assert m.num_cached_blocks == 0
    m.free("b")
    m.check_invariants()


def test_bad_sizes_raise() -> None:
    try:
        KVCacheManager(0, 16)
    except ValueError as e:
        assert "num_blocks" in str(e)
    else:
        raise AssertionError("num_blocks=0 accepted")


ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "grow", "free"]),
        st.integers(0, 5),  # request slot
        st.integers(1, 14),  # tokens
        st.integers(0, 2),  # which shared prefix
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_keep_invariants(operations: list[tuple[str, int, int, int]]) -> None:
    m = kv(10)
    prefixes = [[1] * 8, [2] * 8, [3, 4] * 4]
    seqs: dict[str, list[int]] = {}
    for op, slot, n, which in operations:
        rid = f"r{slot}"
        if op == "admit" and rid not in seqs:
            tokens = prefixes[which][:n] + list(range(50 + slot, 50 + slot + n))
            hit = m.lookup(rid, tokens)
            assert hit.num_tokens < len(tokens)
            if m.allocate(rid, len(tokens), hit):
                m.cache_blocks(rid, tokens, len(tokens))
                seqs[rid] = tokens
            else:
                m.free(rid)
        elif op == "grow" and rid in seqs:
            tokens = seqs[rid] + [7] * n
            if m.allocate(rid, len(tokens)):
                seqs[rid] = tokens
                m.cache_blocks(rid, tokens, len(tokens))
        elif op == "free" and rid in seqs:
            m.free(rid)
            del seqs[rid]
        m.check_invariants()
        assert m.num_used_blocks + m.num_free_blocks == m.num_blocks
    for rid in list(seqs):
        m.free(rid)
    m.check_invariants()
    assert m.num_used_blocks == 0 and m.num_free_blocks == m.num_blocks


@pytest.mark.parametrize("scope", ["shared", "finished"])
@pytest.mark.parametrize("seed", range(60))
def test_the_manager_behaves_like_the_plain_policy(seed: int, scope: str) -> None:
    """Block for block, hit for hit: unique prompts (registered without hashing), shared
    prefixes, the same content computed twice, re-admissions, partial registration,
    roll-backs of draft blocks, evictions and resets; with a cache every request feeds and
    with one only finished requests feed (llama-server's)."""
    rng = random.Random(seed)
    bs, num_blocks = rng.choice([1, 2, 4]), rng.randint(3, 30)
    vocab = rng.choice([3, 50, 1000])  # 3: everything shares; 1000: almost nothing does
    prefixes = [[rng.randint(0, vocab) for _ in range(12)] for _ in range(4)] + [[]]
    rids = [f"r{i}" for i in range(8)]
    if scope == "finished":
        m: KVCacheManager = FinishedScopeKVCache(num_blocks, bs)
        ref: PlainKVCache = PlainFinishedScopeKVCache(num_blocks, bs)
    else:
        m, ref = KVCacheManager(num_blocks, bs), PlainKVCache(num_blocks, bs)
    seqs: dict[str, list[int]] = {}
    gone: dict[str, list[int]] = {}
    for _ in range(150):
        op = rng.choice(["admit", "admit", "grow", "free", "free", "part", "trim", "reset"])
        rid = rng.choice(rids)
        if op == "admit" and rid not in seqs:
            tokens = rng.choice(prefixes)[: rng.randint(0, 12)]
            tokens += [rng.randint(0, vocab) for _ in range(rng.randint(1, 12))]
            if rid in gone and rng.random() < 0.5:
                tokens = gone[rid]  # re-admitted, as after a preemption
            hit, want = m.lookup(rid, tokens), ref.lookup(rid, tokens)
            assert hit == want
            ok = m.allocate(rid, len(tokens), hit)
            assert ok == ref.allocate(rid, len(tokens), want)
            if ok:
                computed = rng.randint(hit.num_tokens, len(tokens))
                m.cache_blocks(rid, tokens, computed)
                ref.cache_blocks(rid, tokens, computed)
                seqs[rid] = tokens
            else:
                m.free(rid)
                ref.free(rid)
        elif op == "grow" and rid in seqs:
            tokens = seqs[rid] + [rng.randint(0, vocab) for _ in range(rng.randint(1, 6))]
            ok = m.allocate(rid, len(tokens))
            assert ok == ref.allocate(rid, len(tokens))
            if ok:
                seqs[rid] = tokens
                m.cache_blocks(rid, tokens, len(tokens))
                ref.cache_blocks(rid, tokens, len(tokens))
        elif op == "part" and rid in seqs:
            computed = rng.randint(0, len(seqs[rid]))
            m.cache_blocks(rid, seqs[rid], computed)
            ref.cache_blocks(rid, seqs[rid], computed)
        elif op == "trim" and rid in seqs:
            # As after a verification step: drafts past the verified tokens are dropped.
            drafts = rng.randint(1, 6)
            verified = len(seqs[rid])
            if m.allocate(rid, verified + drafts):
                assert ref.allocate(rid, verified + drafts)
                assert m.trim(rid, verified) == ref.trim(rid, verified)
        elif op == "free":
            m.free(rid)
            ref.free(rid)
            if rid in seqs:
                gone[rid] = seqs.pop(rid)
        elif op == "reset" and rng.random() < 0.2:
            assert m.reset_prefix_cache() and ref.reset_prefix_cache()
        assert {r: m.block_table(r) for r in rids} == {r: ref.block_table(r) for r in rids}
        assert [m.ref_count(b) for b in range(num_blocks)] == [
            ref.ref_count(b) for b in range(num_blocks)
        ]
        assert (m.num_free_blocks, m.num_cached_blocks) == (
            ref.num_free_blocks,
            ref.num_cached_blocks,
        )
        assert (m.evictions, m.prefix_cache_hits) == (ref.evictions, ref.prefix_cache_hits)
        assert m.prefix_cache_queries == ref.prefix_cache_queries
        m.check_invariants()
    for rid in list(seqs):
        m.free(rid)
        ref.free(rid)
    assert m.allocate("all", num_blocks * bs) and ref.allocate("all", num_blocks * bs)
    assert m.block_table("all") == ref.block_table("all")  # the whole hand-out order


def test_unique_prompts_are_registered_without_hashing_them(monkeypatch) -> None:
    """Only a prompt's first block is hashed until another request comes with the same one;
    then the first request's blocks are hashed and hit."""
    calls = []
    monkeypatch.setattr(kv_block_chain, "hash", lambda x: calls.append(x) or hash(x), raising=False)
    m = kv(64)
    for i in range(3):
        run_prefill(m, f"u{i}", [100 + i] + [7] * 39)  # ten full blocks each
    assert len(calls) == 3 and m.num_cached_blocks == 30
    m.free("u0")
    calls.clear()
    assert run_prefill(m, "again", [100] + [7] * 39 + [1]) == 40
    assert len(calls) == 2 * 10  # u0's ten blocks when it was looked up, and again's own
    m.check_invariants()


def test_colliding_chain_hashes_cost_misses_never_wrong_hits(monkeypatch) -> None:
    """With a hash that collides all the time (five values), deferred groups meet keyed
    blocks under their hashes: the bookkeeping stays consistent and every hit holds the
    tokens looked up."""
    builtin_hash = hash
    for module in (kv_block_chain, kv_cache):  # the chains and the invariants' check
        monkeypatch.setattr(module, "hash", lambda x: builtin_hash(x) % 5, raising=False)
    rng = random.Random(0)
    m = kv(12)
    content: dict[int, tuple[int, ...]] = {}  # what each block was last computed with
    live: list[str] = []
    for n in range(400):
        tokens = [rng.randint(0, 4) for _ in range(rng.randint(1, 14))]
        rid = f"r{n}"
        hit = m.lookup(rid, tokens)
        for i, b in enumerate(hit.blocks):
            assert content[b] == tuple(tokens[i * BS : (i + 1) * BS])
        if m.allocate(rid, len(tokens), hit):
            table = m.block_table(rid)
            for i in range(len(hit.blocks), len(tokens) // BS):
                content[table[i]] = tuple(tokens[i * BS : (i + 1) * BS])
            m.cache_blocks(rid, tokens, len(tokens))
            live.append(rid)
        else:
            m.free(rid)
        if len(live) > 2:
            m.free(live.pop(rng.randrange(len(live))))
        m.check_invariants()
