"""N-gram (prompt lookup) proposer: copy what followed the last occurrence of the suffix.

For each request: take the longest suffix of ``token_ids`` between ``min_n`` and ``max_n``
tokens that also occurs earlier in ``token_ids`` (prompt or output), and propose the tokens
that followed its most recent earlier occurrence. No match: no drafts.

A match may end right before the suffix itself (a repeating pattern); the copy then runs
on into the drafts it has just produced, as an LZ77 back-reference does, so a loop of
period p is continued for the full ``max_tokens`` rather than stopping after p tokens.

Cost: each request keeps a dict from n-gram to the end index of its latest occurrence,
updated incrementally as tokens arrive (``max_n - min_n + 1`` inserts per token), so a
proposal is ``max_n - min_n + 1`` dict lookups whatever the context length.
"""

from __future__ import annotations

from servelab.engine.spec.proposer import DraftRequest


class _Index:
    """The n-grams of one request's tokens, except those ending at its last token."""

    __slots__ = ("latest_end", "num_indexed")

    def __init__(self) -> None:
        self.latest_end: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # n-grams ending before this index are in latest_end


class NgramProposer:
    """Prompt-lookup proposer (see the module docstring)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._indexes: dict[str, _Index] = {}

    def propose(self, batch: list[DraftRequest]) -> dict[str, list[int]]:
        return {
            r.request_id: self.propose_one(r.request_id, r.token_ids, r.max_tokens) for r in batch
        }

    def propose_one(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        """Drafts for one request (see the module docstring)."""
        index = self._indexes.get(request_id)
        if index is None or index.num_indexed > len(token_ids):
            index = self._indexes[request_id] = _Index()
        self._extend(index, token_ids)
        end = len(token_ids)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            match_end = index.latest_end.get(tuple(token_ids[end - n :]))
            if match_end is not None:
                return _copy_after(token_ids, match_end, max_tokens)
        return []

    def remove(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def _extend(self, index: _Index, token_ids: list[int]) -> None:
        # Index the n-grams that end at indices num_indexed .. len - 2: the last token's are
        # the suffix being looked up, and must not match themselves.
        table = index.latest_end
        for i in range(index.num_indexed, len(token_ids) - 1):
            for n in range(self.min_n, min(self.max_n, i + 1) + 1):
                table[tuple(token_ids[i - n + 1 : i + 1])] = i
        index.num_indexed = max(index.num_indexed, len(token_ids) - 1)


def _copy_after(token_ids: list[int], match_end: int, count: int) -> list[int]:
    """``count`` tokens following index ``match_end``, continuing into the copy itself."""
    out: list[int] = []
    n = len(token_ids)
    for src in range(match_end + 1, match_end + 1 + count):
        out.append(token_ids[src] if src < n else out[src - n])
    return out
