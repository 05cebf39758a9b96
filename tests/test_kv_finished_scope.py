"""llama-server's prefix reuse (``engine.kv.finished_scope``): a prompt reuses what finished
requests computed, never what a running request holds."""

from __future__ import annotations

import pytest

from servelab.engine.engine_config import EngineConfig
from servelab.engine.kv.finished_scope import FinishedPrefixes, FinishedScopeKVCache
from servelab.engine.kv.kv_cache import KVCacheManager

DOC = list(range(100, 200))  # a 100-token document two prompts share


def _serve(m: KVCacheManager, rid: str, tokens: list[int]) -> int:
    """Admit a prompt as the scheduler does (look up, allocate, compute); its hit."""
    hit = m.lookup(rid, tokens)
    assert m.allocate(rid, len(tokens), hit)
    m.cache_blocks(rid, tokens, len(tokens))
    return hit.num_tokens


def test_a_prefix_only_a_running_request_holds_is_computed_again():
    shared, scoped = KVCacheManager(1000, 1), FinishedScopeKVCache(1000, 1)
    a = [1, *DOC, 2]  # the request's token list, which its answer extends
    for m in (shared, scoped):
        assert _serve(m, "a", a) == 0
    # "a" still runs: the shared cache finds the document, llama-server's does not
    assert _serve(shared, "b", [1, *DOC, 3]) == 101
    assert _serve(scoped, "b", [1, *DOC, 3]) == 0
    # once "a" has finished, its tokens (prompt and answer) are reusable
    a += [7, 8]
    assert scoped.allocate("a", len(a))
    scoped.cache_blocks("a", a, len(a) - 1)  # the answer decoded; its last token not yet
    scoped.free("a")
    assert _serve(scoped, "c", [1, *DOC, 2, 7, 9]) == 103
    # c holds a's tokens now; b's are reusable once b finishes
    assert _serve(scoped, "d", [1, *DOC, 3, 4]) == 0
    scoped.free("b")
    assert _serve(scoped, "e", [1, *DOC, 3, 4]) == 102


def test_a_finished_requests_tokens_serve_one_request_at_a_time():
    m = FinishedScopeKVCache(1000, 1)
    _serve(m, "a", [1, *DOC, 2])
    m.free("a")
    assert _serve(m, "b", [1, *DOC, 3]) == 101  # b's slot loads what a left
    assert _serve(m, "c", [1, *DOC, 4]) == 0  # while b runs, nothing else holds it
    m.free("b")
    assert _serve(m, "d", [1, *DOC, 5]) == 101
    # a prompt keeping under half of a finished request's tokens leaves them to others
    m.free("d")
    assert _serve(m, "e", [1, *DOC[:40], 6]) == 41
    assert _serve(m, "f", [1, *DOC, 5, 6]) == 102


def test_the_oldest_finished_requests_are_forgotten_past_the_pools_size():
    f = FinishedPrefixes(capacity=7)
    f.add([1, 2, 3, 4])
    f.add([1, 2, 9])
    assert f.best([1, 2, 3, 0]) == (0, 3) and f.best([1, 2, 9, 9]) == (1, 3)
    f.add([7, 7])  # nine tokens held: the first is forgotten
    assert f.best([1, 2, 3, 4]) == (1, 2) and f.best([5]) == (None, 0)


def test_the_scope_is_named_and_checked():
    with pytest.raises(ValueError, match="prefix_cache_scope"):
        EngineConfig(prefix_cache_scope="slot").validate()  # type: ignore[arg-type]
