"""Multi-turn history resent as text, and where it stops matching the prefix cache.

A session's next turn carries the conversation so far as text (``bench.runner``: each
earlier prompt, its answer, a blank line), and the server tokenizes it again. A sampled
answer is not always tokenized back into the tokens that were generated (the model can
emit a split the tokenizer would not make), so the prefix cache stops at the block where
they first differ and the rest of the history is prefilled again. In the agent workload
here that was 12% more prefill tokens than an exact resend, and a simulation that resent
the exact tokens had TTFT p50/p95 4%/15% low (docs/design/sim.md).

The simulator models it as a constant hazard: each answer token is, independently with
probability ``per_token``, the first where the resent history differs. :func:`measure`
estimates it from real runs (divergences over the answer tokens at risk, at block
granularity); :func:`divergence_at` draws the position for one request, seeded by its id.
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Any


def measure(runs: list[Any]) -> dict[str, float] | None:
    """``{"per_token", "turns", "diverged"}`` from loaded runs (``analyze.rundir.Run``);
    None when no session turn resent a full block of an earlier answer.

    For each later turn whose prompt holds the previous turn's prompt and answer, the
    answer's cacheable tokens (those in full blocks with computed K/V) are at risk. A
    prefix hit short of them is a divergence in the block after the hit (counted at its
    middle); a hit over all of them is an answer that came back intact. Evictions would
    look like divergences: measure on runs whose KV pool was not full.
    """
    diverged = turns = 0
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
                a, b = run.timelines.get(prev.request_id), run.timelines.get(nxt.request_id)
                if a is None or b is None or b.prompt_tokens < a.prompt_tokens + a.output_tokens:
                    continue  # the history was not carried
                start = a.prompt_tokens
                end = (start + a.output_tokens - 1) // bs * bs  # the last token has no K/V
                if end <= start:
                    continue
                hit = b.chunks[0].cached_tokens if b.chunks else b.cached_tokens
                turns += 1
                if hit >= end:
                    at_risk += end - start
                else:
                    diverged += 1
                    at_risk += max(hit - start, 0) + bs / 2
    if not turns:
        return None
    return {"per_token": diverged / at_risk, "turns": turns, "diverged": diverged}


def divergence_at(per_token: float, key: str) -> float:
    """Answer position where the resent history first differs (``inf``: it never does)."""
    if per_token <= 0:
        return math.inf
    if per_token >= 1:
        return 0
    u = random.Random(f"resend:{key}").random()
    return math.floor(math.log1p(-u) / math.log1p(-per_token))
