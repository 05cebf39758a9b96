"""KV-cache roll-back after rejected drafts: give back blocks that hold only rejected positions.

A verification step writes K/V for every draft position, so the scheduler grows a request's
block table to cover them. After verification only ``num_computed_tokens`` positions hold
verified K/V; blocks past ``blocks_needed(num_computed_tokens)`` hold nothing but rejected
drafts and are freed. Block hashes need no roll-back: ``cache_blocks`` registers only full
blocks below ``num_computed_tokens``, so a block with an unverified token is never hashed.

``trim`` belongs in ``KVCacheManager`` itself; it lives in this subclass because that file
has another owner (the engine uses this class only when speculation is configured).
"""

from __future__ import annotations

from servelab.engine.kv_cache import KVCacheManager


class RollbackKVCacheManager(KVCacheManager):
    """``KVCacheManager`` plus ``trim`` (see the module docstring)."""

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Free the request's blocks beyond the first ``blocks_needed(num_tokens)``; return
        how many were freed. Those blocks must hold no verified position."""
        table = self._tables.get(request_id)
        keep = self.blocks_needed(num_tokens)
        if table is None or len(table) <= keep:
            return 0
        tail = table[keep:]
        del table[keep:]
        # Release the tail through free() under a throw-away id, so each block is returned
        # exactly as free() returns blocks (reference counts, hand-out order).
        tail_id = f"{request_id}\x00rolled-back"
        self._tables[tail_id] = tail
        self.free(tail_id)
        return len(tail)
