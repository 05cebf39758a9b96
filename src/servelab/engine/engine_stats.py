"""A snapshot of the engine's counters (what /metrics and the step loop report)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class EngineStats:
    """Engine state at one moment.

    ``prefix_cache_queries``/``prefix_cache_hits`` count tokens, vLLM's meaning: every
    admission queries its whole token sequence and hits the tokens served from the cache,
    so hits / queries is the token hit rate. ``evictions`` counts cached blocks reused for
    other content. ``num_preemptions`` is the total since start.
    """

    kv_blocks_used: int
    kv_blocks_total: int
    kv_usage: float  # 0..1
    prefix_cache_queries: int
    prefix_cache_hits: int
    evictions: int
    num_preemptions: int
    num_waiting: int
    num_running: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
