"""The batch plan: what the scheduler asks an executor to run in one step.

This is the contract between policy (scheduler, KV cache) and execution (the torch
model runner, the simulator's cost model, a disaggregated worker). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from servelab.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step.

    The executor computes K/V for ``token_ids`` at positions
    ``start_pos .. start_pos + len(token_ids) - 1`` and writes them into the paged
    cache through ``block_table`` (position p lives in block ``block_table[p //
    block_size]`` at slot ``p % block_size``). Attention for those tokens reads
    positions ``0 .. start_pos + i`` from the cache (causal).

    ``block_table`` is the KV-cache manager's own list for the request, not a copy (a
    copy per sequence per step was the simulator's largest single cost). An executor
    reads it during ``execute`` only: it must not change it, and must not keep it (or
    this plan) past the step, because the scheduler grows, trims and frees it afterwards.
    The other lists (``token_ids``, ``banned_token_ids``, ``draft_token_ids``) are the plan's own.

    If ``sample`` is True the executor samples one next token from the logits of the
    last token in ``token_ids`` (logits are computed only there). With
    ``draft_token_ids`` (speculative decoding) those tokens follow ``token_ids`` in
    the same forward pass, and the executor verifies them; the block table then also
    covers the draft positions.

    ``banned_token_ids`` must get zero probability (EOS/stop ids before
    ``min_tokens``). ``num_output_tokens`` is how many output tokens the request had
    before this step; with ``sampling.seed`` the executor derives the generator from
    (seed, num_output_tokens) so that sampling is reproducible under any batching.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    sampling: SamplingParams
    num_output_tokens: int = 0
    banned_token_ids: list[int] = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def is_prefill(self) -> bool:
        """A prefill chunk computes prompt (or recomputed) tokens; a decode step feeds one."""
        return len(self.token_ids) > 1 or not self.sample


@dataclass
class BatchPlan:
    step_id: int
    seqs: list[ScheduledSeq]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) + len(s.draft_token_ids) for s in self.seqs)


@dataclass
class StepOutput:
    """What the executor returns for a plan.

    ``sampled[request_id]`` holds the new tokens for every seq with ``sample=True``:
    one token normally, or the accepted drafts plus one bonus/correction token with
    speculative decoding. ``elapsed`` is the executor's own time for the step
    (seconds): measured by the torch runner, predicted by a cost model.
    """

    sampled: dict[str, list[int]]
    elapsed: float = 0.0
