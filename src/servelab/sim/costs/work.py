"""The work of one engine step, reduced to the sums every cost model needs.

A :class:`StepWork` is built from a :class:`~servelab.engine.batch_plan.BatchPlan` (in the
simulator) or from a recorded step (calibration). It is plain arithmetic so that the
simulator spends microseconds per step on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelab.engine.batch_plan import BatchPlan


@dataclass(slots=True)
class StepWork:
    """Sums over the sequences of one step.

    - ``tokens``: tokens computed (prompt chunks, decode inputs, draft tokens);
    - ``prefill_tokens`` / ``decode_seqs``: the split the step records use;
    - ``seqs``: sequences in the step;
    - ``logits``: positions whose logits are computed (one per sampled sequence, plus
      its draft tokens);
    - ``attn_pairs``: causal (query, key) pairs, sum of ``n*s + n*(n+1)/2`` for a
      chunk of ``n`` new tokens after ``s`` cached ones;
    - ``kv_read``: context tokens whose K/V are read, sum of ``s + n``.
    """

    tokens: int = 0
    prefill_tokens: int = 0
    decode_seqs: int = 0
    seqs: int = 0
    logits: int = 0
    attn_pairs: float = 0.0
    kv_read: int = 0

    def add(self, new_tokens: int, context_before: int, logits: int) -> None:
        """Account one sequence computing ``new_tokens`` after ``context_before`` tokens.

        It is a decode when every computed position yields logits (one token, or one
        plus its drafts), else a prefill chunk.
        """
        n, s = new_tokens, context_before
        self.tokens += n
        self.seqs += 1
        self.logits += logits
        self.attn_pairs += n * s + n * (n + 1) / 2
        self.kv_read += s + n
        if logits == n:
            self.decode_seqs += 1
        else:
            self.prefill_tokens += n


def work_of_plan(plan: BatchPlan, imported: set[str] | frozenset = frozenset()) -> StepWork:
    """The work of a batch plan.

    Sequences in ``imported`` had their prompt KV delivered by a transfer (disaggregated
    decode): their prompt chunk costs nothing, and the chunk that samples costs one
    decode token at its full context.
    """
    # Inlined StepWork.add: this runs once per sequence per simulated step.
    tokens = prefill = decode = seqs = logits = kv_read = 0
    pairs = 0.0
    for s in plan.seqs:
        drafts = len(s.draft_token_ids)
        n = len(s.token_ids) + drafts
        start = s.start_pos
        if imported and s.request_id in imported:
            if not s.sample:
                continue
            start, n = start + n - 1, 1
        lg = 1 + drafts if s.sample else 0
        tokens += n
        seqs += 1
        logits += lg
        pairs += n * start + n * (n + 1) / 2
        kv_read += start + n
        if lg == n:
            decode += 1
        else:
            prefill += n
    return StepWork(tokens, prefill, decode, seqs, logits, pairs, kv_read)


def decode_work(num_seqs: int, context_tokens: int) -> StepWork:
    """The work of a step in which ``num_seqs`` sequences each decode one token, after
    ``context_tokens`` cached tokens in all: what :func:`work_of_plan` gives for that plan
    (its pair sum is of whole numbers, so the float is exact), without building the plan."""
    n, kv = num_seqs, context_tokens + num_seqs
    return StepWork(n, 0, n, n, n, float(kv), kv)
