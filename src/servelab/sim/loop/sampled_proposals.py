"""Drafts in only some steps, as real text gets them.

An n-gram proposer drafts when the sequence's last tokens occurred before in it. The
simulator's executor emits placeholder tokens that repeat, so over them the lookup matches
in every step, where real output matched in a share of its steps (3% of a sampled code
answer's steps here, most of a copy-edit's). :class:`SampledProposals` passes the inner
proposer's drafts on for a sequence's step with probability ``rate`` (one seeded stream per
replica) and gives no drafts otherwise: an ordinary decode step, as when the lookup misses.
"""

from __future__ import annotations

import random

from servelab.engine.spec.proposer import DraftRequest, Proposer


class SampledProposals:
    """A :class:`~servelab.engine.spec.proposer.Proposer` whose drafts reach a sequence's
    step with probability ``rate``."""

    def __init__(self, inner: Proposer, rate: float, seed: int) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"a proposal rate is a share of steps, got {rate}")
        self.inner = inner
        self.rate = rate
        self._rng = random.Random(f"proposals:{seed}")

    def propose(self, batch: list[DraftRequest]) -> dict[str, list[int]]:
        drafts = self.inner.propose(batch)
        return {rid: d if self._rng.random() < self.rate else [] for rid, d in drafts.items()}

    def remove(self, request_id: str) -> None:
        self.inner.remove(request_id)
