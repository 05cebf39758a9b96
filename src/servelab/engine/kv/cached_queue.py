"""The fast KV cache's queue of cached blocks that nobody holds, for eviction in LRU order."""

from __future__ import annotations


class CachedQueue:
    """Cached blocks in the order they were queued: the least recently freed first.

    Contract: ``extend`` queues blocks at the back, ``remove`` takes a queued block out from
    anywhere (a prefix hit revives it), ``take(n)`` takes the first ``n`` (at most
    ``len``) off the front, and ``len`` counts the queued blocks; each is O(1) per block. A
    block that left may be queued again.

    How: a list read from a head. A block that leaves from the middle leaves its entry
    behind, stale: ``_stale[b]`` counts b's stale entries, which come before any live one of
    b, and are skipped when read.
    """

    __slots__ = ("_entries", "_head", "_live", "_num_stale", "_stale")

    def __init__(self, num_blocks: int) -> None:
        self._entries: list[int] = []
        self._head = 0
        self._live = 0  # live entries
        self._num_stale = 0  # stale entries
        self._stale = [0] * num_blocks

    def __len__(self) -> int:
        return self._live

    def extend(self, blocks: list[int]) -> None:
        self._entries += blocks
        self._live += len(blocks)

    def remove(self, b: int) -> None:
        """Take queued block ``b`` out of the middle: its entry goes stale."""
        self._stale[b] += 1
        self._num_stale += 1
        self._live -= 1

    def take(self, n: int) -> list[int]:
        """Take the first ``n`` live entries off the queue."""
        entries, head = self._entries, self._head
        if not self._num_stale:  # the usual case: one slice
            out = entries[head : head + n]
            head += n
        else:
            stale = self._stale
            out = []
            while len(out) < n:
                b = entries[head]
                head += 1
                if stale[b]:
                    stale[b] -= 1
                    self._num_stale -= 1
                else:
                    out.append(b)
        self._live -= n
        if head > 4096 and 2 * head > len(entries):  # drop the consumed front now and then
            del entries[:head]
            head = 0
        self._head = head
        return out

    def blocks(self) -> list[int]:
        """The queued blocks, front first, after checking the stale counts (AssertionError
        if they are inconsistent; tests call it)."""
        stale = list(self._stale)
        live = []
        for b in self._entries[self._head :]:
            if stale[b]:
                stale[b] -= 1
            else:
                live.append(b)
        assert not any(stale), "a stale count without its entry"
        assert len(self._entries) - self._head - len(live) == self._num_stale, "stale entries"
        assert len(live) == self._live, "LRU length"
        return live
