"""Multi-turn history resent as text, and where it stops matching the prefix cache.

A session's next turn carries the conversation so far as text (``bench.runner``: each
earlier prompt, its answer, a blank line), and the server tokenizes it again. A sampled
answer is not always tokenized back into the tokens that were generated (the model can
emit a split the tokenizer would not make), so the prefix cache stops at the block where
they first differ and the rest of the history is prefilled again. In the agent workload
here that was 12% more prefill tokens than an exact resend, and a simulation that resent
the exact tokens had TTFT p50/p95 4%/15% low (docs/design/sim.md).

The simulator models two ways it happens (:class:`Resend`): at the answer's very start,
where its first tokens meet the end of the prompt text and tokenize together (3-4 of 30
later agent turns per run here, against 1 that a constant hazard predicts), and then
independently for each answer token with probability ``per_token``. :func:`measure`
estimates both from real runs, at block granularity; :meth:`Resend.cut` draws the position
for one request, seeded by its id.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Resend:
    """How a resent history diverges: with probability ``at_start`` from the answer's first
    block, else from each answer token with probability ``per_token`` (0, 0: never)."""

    per_token: float = 0.0
    at_start: float = 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Resend:
        d = d or {}
        return cls(float(d.get("per_token", 0.0)), float(d.get("at_start", 0.0)))

    def cut(self, key: str) -> float:
        """Answer position where the resent history first differs (``inf``: it never does)."""
        rng = random.Random(f"resend:{key}")
        if rng.random() < self.at_start:
            return 0
        if self.per_token <= 0:
            return math.inf
        if self.per_token >= 1:
            return 0
        return math.floor(math.log1p(-rng.random()) / math.log1p(-self.per_token))


def measure(runs: list[Any]) -> dict[str, float] | None:
    """``{"per_token", "at_start", "turns", "diverged"}`` from loaded runs
    (``servelab.rundir.Run``); None when no session turn resent a full block of an earlier
    answer.

    For each later turn whose prompt holds the previous turn's prompt and answer, the
    answer's cacheable tokens (those in full blocks with computed K/V) are at risk. A
    prefix hit that stops in or before the block holding the answer's first token is a
    divergence at the start (``at_start``, over all turns). Past that block, a hit short of
    the answer's end is a divergence in the block after the hit (counted at its middle) and
    a hit over all of it an answer that came back intact; they give ``per_token`` over the
    tokens at risk. Evictions would look like divergences: measure on runs whose KV pool was
    not full.
    """
    diverged = turns = at_start = 0
    at_risk = 0.0
    for run in runs:
        bs = int((run.engine_config or {}).get("block_size", 16))
        sessions: dict[str, list[Any]] = {}
        for r in run.records:
            if r.session_id is not None and r.ok:
                sessions.setdefault(r.session_id, []).append(r)
        for recs in sessions.values():
            recs.sort(key=lambda r: r.turn)
            for prev, nxt in itertools.pairwise(recs):
                a, b = run.timeline_for(prev), run.timeline_for(nxt)
                if a is None or b is None or b.prompt_tokens < a.prompt_tokens + a.output_tokens:
                    continue  # the history was not carried
                start = a.prompt_tokens
                end = (start + a.output_tokens - 1) // bs * bs  # the last token has no K/V
                if end <= start:
                    continue
                hit = b.chunks[0].cached_tokens if b.chunks else b.cached_tokens
                turns += 1
                if hit <= start:
                    at_start += 1
                    continue
                first = start // bs * bs + bs  # the end of the answer's first block
                if hit >= end:
                    at_risk += end - first
                else:
                    diverged += 1
                    at_risk += hit - first + bs / 2
    if not turns:
        return None
    return {
        "per_token": diverged / at_risk if at_risk > 0 else 0.0,
        "at_start": at_start / turns,
        "turns": turns,
        "diverged": diverged + at_start,
    }
