"""The n-gram (prompt lookup) proposer on crafted token sequences, and against a brute force."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.engine.spec.ngram import NgramProposer
from servelab.engine.spec.proposer import DraftRequest


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, spelt out: longest suffix with an earlier occurrence, latest one wins,
    and the copy runs on into its own output."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                seq = list(tokens)
                for i in range(k):
                    seq.append(seq[start + n + i])
                return seq[len(tokens) :]
    return []


def test_longest_suffix_wins() -> None:
    # (8, 9) occurs after 3 and after 7; the 3-gram (7, 8, 9) only after the 7.
    tokens = [7, 8, 9, 1, 2, 3, 8, 9, 4, 5, 7, 8, 9]
    p = NgramProposer(min_n=2, max_n=3)
    assert p.propose_one("r", tokens, 3) == [1, 2, 3]
    # Only bigrams allowed: the latest earlier (8, 9) is the one followed by 4, 5.
    assert NgramProposer(min_n=2, max_n=2).propose_one("r", tokens, 2) == [4, 5]


def test_no_match_means_no_drafts() -> None:
    p = NgramProposer(min_n=2, max_n=4)
    assert p.propose_one("r", [1, 2, 3, 4, 5, 6], 4) == []
    assert p.propose_one("short", [1], 4) == []
    # A unigram repeat is not enough when min_n is 2.
    assert p.propose_one("u", [5, 1, 2, 5], 3) == []


def test_match_at_the_end_continues_into_its_own_drafts() -> None:
    p = NgramProposer(min_n=2, max_n=3)
    # The suffix (1, 2) last occurred right before the final 3: copying continues the loop.
    assert p.propose_one("loop", [1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]
    # A run of one token: the overlapping match proposes the run's continuation.
    assert p.propose_one("run", [4, 7, 7, 7], 4) == [7, 7, 7, 7]


def test_at_most_max_tokens_and_batch_api() -> None:
    p = NgramProposer(min_n=1, max_n=2)
    out = p.propose([DraftRequest("a", [1, 2, 3, 4, 1], 2), DraftRequest("b", [9, 8, 7], 3)])
    assert out == {"a": [2, 3], "b": []}


def test_incremental_index_follows_growing_sequences_and_remove() -> None:
    p = NgramProposer(min_n=2, max_n=3)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    assert p.propose_one("r", tokens, 3) == []
    tokens += [1, 5]  # now (1, 5) recurs
    assert p.propose_one("r", tokens, 3) == [9, 2, 6]
    p.remove("r")
    assert p.propose_one("r", [3, 1, 4], 3) == []  # a fresh index after remove


@settings(max_examples=300, deadline=None)
@given(
    chunks=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=12), min_size=1, max_size=5),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 2),
    k=st.integers(1, 6),
)
def test_matches_brute_force_as_tokens_arrive(
    chunks: list[list[int]], min_n: int, extra: int, k: int
) -> None:
    p = NgramProposer(min_n, min_n + extra)
    tokens: list[int] = []
    for chunk in chunks:
        tokens += chunk
        assert p.propose_one("r", tokens, k) == brute_force(tokens, min_n, min_n + extra, k)
