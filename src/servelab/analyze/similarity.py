"""Request similarity: how much of the prompts an ideal prefix cache would have reused.

``ideal_prefix_reuse(prompts, block_size)`` walks the prompts in send order with an
unbounded, never-evicting cache of full KV blocks keyed by their whole prefix (as vLLM's
block hashes are): a prompt reuses its leading full blocks already seen, and adds all of
its full blocks. The figure is reused tokens / prompt tokens, overall and per class: an
upper bound for any real prefix cache of that block size, beside which the server's
measured hit rate (``prefix_cache_hit_rate``) says how much of it was taken.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

DEFAULT_BLOCK_SIZE = 16  # vLLM's and servelab's default tokens per KV block


def ideal_prefix_reuse(
    prompts: Iterable[tuple[str, Sequence[int]]], block_size: int = DEFAULT_BLOCK_SIZE
) -> dict[str, Any]:
    """``prompts``: (class, token ids) in send order. Returns ``{"overall": f, "by_class":
    {class: f}, "block_size", "prompt_tokens"}``, each ``f`` a fraction (None: no tokens)."""
    seen: set[int] = set()
    reused: dict[str, int] = {}
    total: dict[str, int] = {}
    for cls, ids in prompts:
        parent, hit = 0, 0
        matching = True
        for start in range(0, len(ids) - block_size + 1, block_size):
            key = hash((parent, tuple(ids[start : start + block_size])))
            if matching and key in seen:
                hit += block_size
            else:
                matching = False
                seen.add(key)
            parent = key
        reused[cls] = reused.get(cls, 0) + hit
        total[cls] = total.get(cls, 0) + len(ids)
    all_total = sum(total.values())
    return {
        "overall": sum(reused.values()) / all_total if all_total else None,
        "by_class": {k: (reused[k] / total[k] if total[k] else None) for k in sorted(total)},
        "block_size": block_size,
        "prompt_tokens": all_total,
    }


def cache_hit_rate(cached: Iterable[tuple[int | None, int]]) -> float | None:
    """The server's measured prefix-cache hit rate: cached prompt tokens / prompt tokens,
    over the requests whose server reported a cached count (None if none did)."""
    hits = tokens = 0
    for c, n in cached:
        if c is not None:
            hits, tokens = hits + c, tokens + n
    return hits / tokens if tokens else None
