"""A snapshot of the engine's counters (what /metrics and the step loop report)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from servelab.engine.kv.kv_cache_plain import KVCache
    from servelab.engine.scheduler import Scheduler


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

    @classmethod
    def of(cls, kv: KVCache, scheduler: Scheduler) -> EngineStats:
        """The counters of an engine's KV cache and scheduler now."""
        return cls(
            kv_blocks_used=kv.num_used_blocks,
            kv_blocks_total=kv.num_blocks,
            kv_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            evictions=kv.evictions,
            num_preemptions=scheduler.num_preemptions,
            num_waiting=scheduler.num_waiting,
            num_running=scheduler.num_running,
        )

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
