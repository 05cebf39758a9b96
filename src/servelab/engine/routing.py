"""Routing policy: which engine of a deployment gets a request. Pure, and shared by the
simulator's loop and the disaggregated server's router, so both route alike.

- Replica routers (``make_router``): round-robin, least-loaded, prefix-aware. A router sees
  each replica's outstanding request count (routed and not yet finished) and, for
  prefix-aware routing, the prompts it sent there before. It never looks inside an engine, as
  a real front-end router cannot.
- Disaggregated hand-offs: ``pick_prefill`` (the fewest requests routed and not yet handed
  off) and ``pick_decode`` (the most free KV blocks among the engines with room for the
  prompt's blocks, reservations already asked for counted as used).

Ties go to the lowest index everywhere, so a route is a deterministic function of its inputs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol


def pick_prefill(outstanding: Sequence[int]) -> int | None:
    """The engine with the fewest outstanding requests (None when there is none)."""
    if not outstanding:
        return None
    return min(range(len(outstanding)), key=outstanding.__getitem__)


def pick_decode(free_blocks: Sequence[int], need: int) -> int | None:
    """The engine with the most free KV blocks, among those with ``need`` or more free;
    None when no engine has room (the request waits)."""
    fits = [i for i, free in enumerate(free_blocks) if free >= need]
    return max(fits, key=lambda i: (free_blocks[i], -i), default=None)


class Router(Protocol):
    name: str

    def route(self, prompt: list[int], loads: list[int]) -> int:
        """The replica index for a request with ``prompt``, given each replica's load."""
        ...


class RoundRobin:
    name = "round-robin"

    def __init__(self, n: int) -> None:
        self.n = n
        self._next = 0

    def route(self, prompt: list[int], loads: list[int]) -> int:
        i = self._next
        self._next = (i + 1) % self.n
        return i


class LeastLoaded:
    """Fewest outstanding requests; ties go to the lowest index."""

    name = "least-loaded"

    def __init__(self, n: int) -> None:
        self.n = n

    def route(self, prompt: list[int], loads: list[int]) -> int:
        best = pick_prefill(loads)
        assert best is not None, "a router has at least one replica"
        return best


class PrefixAware:
    """Longest cached-prefix match, unless that replica is too loaded (SGLang router's idea).

    Each replica keeps an LRU set of chained hashes of the ``block``-token prompt blocks
    routed to it (at most ``capacity`` blocks, roughly its KV cache). A request goes to
    the replica matching most leading blocks, ties and no match going to the least
    loaded; if the best match's load exceeds the least load by ``balance`` or more,
    load wins. Only the first ``max_blocks`` blocks are hashed, which bounds the cost.
    """

    name = "prefix-aware"

    def __init__(
        self,
        n: int,
        block: int = 16,
        capacity: int = 1 << 16,
        balance: int = 8,
        max_blocks: int = 256,
    ) -> None:
        self.n = n
        self.block = block
        self.capacity = capacity
        self.balance = balance
        self.max_blocks = max_blocks
        self._seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(n)]

    def _hashes(self, prompt: list[int]) -> list[int]:
        out, h, b = [], 0, self.block
        for i in range(min(len(prompt) // b, self.max_blocks)):
            h = hash((h, tuple(prompt[i * b : (i + 1) * b])))
            out.append(h)
        return out

    def route(self, prompt: list[int], loads: list[int]) -> int:
        hashes = self._hashes(prompt)
        least = min(range(self.n), key=loads.__getitem__)
        best, best_len = least, 0
        for i, seen in enumerate(self._seen):
            k = 0
            while k < len(hashes) and hashes[k] in seen:
                k += 1
            if k > best_len or (k == best_len and k > 0 and loads[i] < loads[best]):
                best, best_len = i, k
        if best_len == 0 or loads[best] - loads[least] >= self.balance:
            best = least
        seen = self._seen[best]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)
        return best


ROUTERS: dict[str, type[RoundRobin | LeastLoaded | PrefixAware]] = {
    "round-robin": RoundRobin,
    "least-loaded": LeastLoaded,
    "prefix-aware": PrefixAware,
}


def make_router(name: str, n: int, block: int = 16) -> Router:
    """Build a router by name; raises ValueError naming the choices."""
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")
    if name == "prefix-aware":
        return PrefixAware(n, block=block)
    return ROUTERS[name](n)
