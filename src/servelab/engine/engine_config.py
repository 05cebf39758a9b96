"""Engine configuration: the scheduling and KV-cache knobs (vLLM's names where they exist)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from servelab.engine.spec.spec_config import SpeculativeConfig
from servelab.vocab import DEFAULT_TOKEN_BUDGET

if TYPE_CHECKING:
    from servelab.engine.executor import Executor


@dataclass
class EngineConfig:
    """Scheduling and cache limits.

    ``num_kv_blocks`` None means "size the pool from ``kv_cache_memory_gb``" (the
    runner knows the bytes per block); the simulator sets it directly.
    """

    max_num_batched_tokens: int = DEFAULT_TOKEN_BUDGET  # token budget of one step
    max_num_seqs: int = 64  # cap on sequences in one step
    max_model_len: int | None = None  # None: the model's context length
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 2.0
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_queue: int | None = None  # waiting requests beyond which the server answers 429
    # vLLM's speculative config as JSON data, e.g. {"method": "ngram", "num_speculative_tokens":
    # 4}; None: no speculation. A dict, so the config survives asdict() and the JSON hop.
    speculative_config: dict[str, Any] | None = None
    # Which KV cache runs the policy: "fast" (``kv_cache.KVCacheManager``) or "plain"
    # (``kv_cache_plain.PlainKVCache``, the readable statement it must equal; O(blocks) a call).
    kv_cache: Literal["fast", "plain"] = "fast"
    # Whose computed prefixes a prompt may reuse: "shared", any request's, running or not
    # (vLLM, SGLang); "finished", only finished requests' (llama-server's slots and RAM
    # prompt cache: ``kv.finished_scope``).
    prefix_cache_scope: Literal["shared", "finished"] = "shared"

    def speculative(self) -> SpeculativeConfig | None:
        """The validated speculative config, or None (ValueError if it is malformed)."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_dict(self.speculative_config)

    def validate(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if self.kv_cache not in ("fast", "plain"):
            raise ValueError(f'kv_cache must be "fast" or "plain", got {self.kv_cache!r}')
        if self.prefix_cache_scope not in ("shared", "finished"):
            raise ValueError(
                'prefix_cache_scope must be "shared" or "finished", got '
                f"{self.prefix_cache_scope!r}"
            )
        self.speculative()

    def resolve(self, executor: Executor) -> tuple[EngineConfig, int, int]:
        """A validated copy with ``max_model_len`` and ``num_kv_blocks`` filled in from the
        executor; returns it and those two, which it no longer leaves unset."""
        config = dataclasses.replace(self)
        config.validate()
        model_len = executor.max_model_len
        if config.max_model_len is None:
            config.max_model_len = model_len
        elif config.max_model_len > model_len:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's context of "
                f"{model_len} tokens; leave it unset or lower it"
            )
        if config.num_kv_blocks is None:
            per_block = executor.kv_block_bytes(config.block_size)
            budget_blocks = int(config.kv_cache_memory_gb * 1e9) // per_block
            # More blocks than max_num_seqs full contexts can never be in use at once; the cap
            # keeps a tiny model from allocating gigabytes.
            useful = config.max_num_seqs * -(-config.max_model_len // config.block_size)
            config.num_kv_blocks = min(budget_blocks, useful)
            if config.num_kv_blocks < 1:
                raise ValueError(
                    f"kv_cache_memory_gb={config.kv_cache_memory_gb} holds no KV block of "
                    f"{per_block} bytes; raise it"
                )
        return config, config.max_model_len, config.num_kv_blocks


def default_threads() -> int:
    """Torch threads for an engine core: every CPU this process may use but one.

    The spared CPU runs the API process (HTTP, tokenisation, SSE); with a single CPU the two
    processes share it. ``os.sched_getaffinity`` honours ``taskset``.
    """
    try:
        ncpu = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        ncpu = os.cpu_count() or 1
    return max(1, ncpu - 1)
