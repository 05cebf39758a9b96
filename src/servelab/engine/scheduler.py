"""The step scheduler: which requests run in the next step, and how many tokens each.

Pure Python, no torch: the simulator runs it unchanged against a cost model.

Policy (docs/design/scheduler.md has the reasoning):
- One token budget per step (``max_num_batched_tokens``) and a cap on running sequences
  (``max_num_seqs``).
- Running requests first, in admission order: a decode takes 1 token, an unfinished prefill
  takes the rest of its prompt up to the remaining budget (a chunk).
- Then waiting requests are admitted in priority order (lower value first, FCFS within a
  class), each after a prefix-cache lookup, while budget, cap and KV blocks allow. The queue
  is strict: if the head cannot be admitted, nothing behind it is.
- Out of KV blocks while serving running requests: preempt by recompute -- the lowest
  priority first, then the most recently admitted -- until the request fits or is itself the
  victim. No request is admitted in a step that preempted.
- A waiting request that cannot get blocks may preempt running requests of a strictly lower
  priority (``preempt_for_priority``).
- Chunked prefill off: a prompt is computed whole in one step. One whose uncached part is
  larger than the whole budget runs alone in a step (running decodes pause for that step),
  so any prompt the context allows is admissible.
- A preempted request returns to the front of its priority class, keeps its output, and is
  recomputed as a prefill of prompt + output (the prefix cache often still holds most of it).
- Speculative decoding: a decode also takes its draft tokens (``Request.spec_token_ids``),
  as many as the remaining budget allows; if the blocks for them are short it decodes
  without drafts rather than preempt anyone. After the step the accepted drafts join the
  request's tokens and computed K/V, and the blocks past ``blocks_needed(num_computed)``,
  which hold only rejected drafts, are freed (the KV cache's ``trim``).

Contract with the engine: ``schedule(now)`` -> ``SchedulerOutput`` (the ``BatchPlan`` to run
plus what it means for each request); after the executor ran it, ``update_from_output``
advances the requests and records their timelines; the engine decides when a request is
finished and calls ``finish_request``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from servelab.engine.batch_plan import BatchPlan, ScheduledSeq, StepOutput
from servelab.engine.engine_config import EngineConfig
from servelab.engine.kv.kv_cache_plain import KVCache, PrefixHit
from servelab.engine.request import Request
from servelab.engine.waiting_queue import WaitingQueue
from servelab.vocab import FinishReason, Phase, PrefillChunk, SpecRecord

# The phases the per-sequence paths test and set, bound once: reading an Enum member
# off its class costs about ten times a global lookup.
_QUEUED, _PREFILL, _DECODE = Phase.QUEUED, Phase.PREFILL, Phase.DECODE


@dataclass(slots=True)
class ScheduledEntry:
    """One request's share of a step, as decided by the scheduler."""

    request: Request
    num_tokens: int  # tokens computed this step
    is_prefill: bool  # a prefill chunk (prompt or recompute) rather than a decode
    cached_tokens: int = 0  # prefix-cache tokens skipped at the admission this chunk starts
    num_draft_tokens: int = 0  # speculative tokens verified after the decode token
    num_accepted: int = 0  # of those, how many the executor accepted (set after the step)


@dataclass
class SchedulerOutput:
    """The plan of one step and its meaning per request."""

    plan: BatchPlan
    entries: list[ScheduledEntry]
    admitted: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def prefill(self) -> dict[str, int]:
        return self.prefill_and_decode()[0]

    @property
    def decode(self) -> list[str]:
        return self.prefill_and_decode()[1]

    def prefill_and_decode(self) -> tuple[dict[str, int], list[str]]:
        """Prompt tokens per prefilling request, and the decoding requests (plan order); one
        pass over the entries, as this runs every step."""
        prefill: dict[str, int] = {}
        decode: list[str] = []
        for e in self.entries:
            if e.is_prefill:
                prefill[e.request.request_id] = e.num_tokens
            else:
                decode.append(e.request.request_id)
        return prefill, decode


class _Step:
    """Decisions being made for one step."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.entries: dict[str, ScheduledEntry] = {}
        self.admitted: list[str] = []
        self.preempted: list[str] = []

    def add(self, req: Request, num_tokens: int, num_drafts: int = 0) -> None:
        self.entries[req.request_id] = ScheduledEntry(
            req, num_tokens, req.phase is _PREFILL, req.pending_cached_tokens, num_drafts
        )
        req.pending_cached_tokens = 0
        self.budget -= num_tokens + num_drafts


class Scheduler:
    """Decides each step's batch; owns the waiting queue and the running list."""

    def __init__(
        self, config: EngineConfig, kv_cache: KVCache, preempt_for_priority: bool = True
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.preempt_for_priority = preempt_for_priority
        self.waiting = WaitingQueue()
        self.running: list[Request] = []  # admission order
        self.num_preemptions = 0
        self._next_step_id = 0
        self._admissions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    def add_request(self, req: Request) -> None:
        req.phase = Phase.QUEUED
        self.waiting.push_back(req)

    def finish_request(self, req: Request, reason: FinishReason, now: float) -> None:
        """Remove the request from the queues, free its KV blocks, close its timeline."""
        if req.finished:
            return
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv_cache.free(req.request_id)
        req.phase = Phase.FINISHED
        req.finish_reason = reason
        req.timeline.finished = now
        req.timeline.finish_reason = reason
        req.timeline.output_tokens = req.num_output_tokens

    # ---- scheduling ----

    def schedule(self, now: float) -> SchedulerOutput:
        """Choose the next step's batch (see the module docstring); ``now`` stamps timelines."""
        step = _Step(self.config.max_num_batched_tokens)
        if not self._admit_oversized_alone(step, now):
            self._schedule_running(step, now)
            if not step.preempted:
                self._admit_waiting(step, now)
        step_id = self.reserve_step_ids(1)
        entries = list(step.entries.values())
        # One ScheduledSeq per sequence per step: built inline, with lookups hoisted.
        block_table = self.kv_cache.block_table
        seqs: list[ScheduledSeq] = []
        append = seqs.append
        for e in entries:
            req = e.request
            start = req.num_computed_tokens
            end = start + e.num_tokens
            token_ids = req.token_ids
            num_tokens = len(token_ids)
            sample = end == num_tokens
            num_output = num_tokens - req.num_prompt_tokens
            sp = req.sampling_params
            append(
                ScheduledSeq(
                    req.request_id,
                    token_ids[start:end],
                    start,
                    # The live table, not a copy: plan.py's contract lets executors read it
                    # during the step only. Copying it cost more than the rest of a decode's
                    # scheduling.
                    block_table(req.request_id),
                    sample,
                    sp,
                    num_output,
                    # banned_token_ids() is [] from min_tokens on; the test spares the call.
                    req.banned_token_ids() if sample and num_output < sp.min_tokens else [],
                    req.spec_token_ids[: e.num_draft_tokens] if e.num_draft_tokens else [],
                )
            )
        return SchedulerOutput(BatchPlan(step_id, seqs), entries, step.admitted, step.preempted)

    def reserve_step_ids(self, k: int) -> int:
        """Take the next ``k`` step ids and return the first. ``schedule`` takes one per step;
        steps run without it (the decode burst's) take theirs here, so that ids stay
        consecutive and unique whichever path ran a step."""
        first = self._next_step_id
        self._next_step_id = first + k
        return first

    def _schedule_running(self, step: _Step, now: float) -> None:
        # Runs for every running request every step: attribute lookups are hoisted.
        allocate = self.kv_cache.allocate
        chunked = self.config.enable_chunked_prefill
        for req in list(self.running):
            budget = step.budget
            if budget <= 0:
                break
            if req.phase is _QUEUED:  # preempted earlier in this loop
                continue
            computed = req.num_computed_tokens
            pending = len(req.token_ids) - computed
            n = min(pending, budget)
            if n < pending and not chunked:
                continue
            drafts = min(len(req.spec_token_ids), budget - n) if req.spec_token_ids else 0
            while not allocate(req.request_id, computed + n + drafts):
                if drafts:  # speculation never preempts anyone
                    drafts = 0
                    continue
                victim = max(self.running, key=_preemption_order)
                self._preempt(victim, step, now)
                if victim is req:
                    break
            else:
                step.add(req, n, drafts)

    def _admit_waiting(self, step: _Step, now: float) -> None:
        while self.waiting and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            hit = self.kv_cache.lookup(req.request_id, req.token_ids)
            pending = req.num_tokens - hit.num_tokens
            if self.config.enable_chunked_prefill:
                n = min(pending, step.budget)
            elif pending <= step.budget:
                n = pending
            else:
                return
            if not self._allocate_for_admission(req, hit, n, step, now):
                return
            self._admit(req, hit, n, step, now)

    def _admit_oversized_alone(self, step: _Step, now: float) -> bool:
        """Chunking off: run a head-of-queue prompt larger than the whole budget by itself."""
        if self.config.enable_chunked_prefill or not self.waiting:
            return False
        if len(self.running) >= self.config.max_num_seqs:
            return False
        req = self.waiting.peek()
        hit = self.kv_cache.lookup(req.request_id, req.token_ids)
        n = req.num_tokens - hit.num_tokens
        if n <= step.budget or not self._allocate_for_admission(req, hit, n, step, now):
            return False
        self._admit(req, hit, n, step, now)
        return True

    def _allocate_for_admission(
        self, req: Request, hit: PrefixHit, n: int, step: _Step, now: float
    ) -> bool:
        kv = self.kv_cache
        if kv.allocate(req.request_id, hit.num_tokens + n, hit):
            return True
        lower = [r for r in self.running if r.priority > req.priority]
        if not self.preempt_for_priority or not lower:
            return False
        # Preempt only if evicting every lower-priority request could make room at all.
        reclaimable = kv.num_free_blocks + sum(len(kv.block_table(r.request_id)) for r in lower)
        if kv.blocks_needed(hit.num_tokens + n) > reclaimable:
            return False
        while not kv.allocate(req.request_id, hit.num_tokens + n, hit):
            if not lower:
                return False
            victim = max(lower, key=_preemption_order)
            lower.remove(victim)
            self._preempt(victim, step, now)
        return True

    def adopt_decoding(self, req: Request) -> None:
        """Run ``req`` from the next step on, in DECODE: its whole prompt's KV is already in
        its blocks (a disaggregated hand-off). It counts as admitted now, for preemption order."""
        req.phase = Phase.DECODE
        req.admit_seq = self._admissions
        self._admissions += 1
        self.running.append(req)

    def _admit(self, req: Request, hit: PrefixHit, n: int, step: _Step, now: float) -> None:
        self.waiting.pop()
        self.running.append(req)
        req.phase = Phase.PREFILL
        req.admit_seq = self._admissions
        self._admissions += 1
        req.num_computed_tokens = hit.num_tokens
        req.pending_cached_tokens = hit.num_tokens
        req.timeline.scheduled.append(now)
        req.timeline.cached_tokens += hit.num_tokens
        step.admitted.append(req.request_id)
        step.add(req, n)

    def _preempt(self, victim: Request, step: _Step, now: float) -> None:
        self.running.remove(victim)
        self.kv_cache.free(victim.request_id)
        victim.num_computed_tokens = 0
        victim.pending_cached_tokens = 0
        victim.spec_token_ids = []
        victim.phase = Phase.QUEUED
        victim.timeline.preemptions.append(now)
        victim.timeline.queued.append(now)
        self.waiting.push_front(victim)
        self.num_preemptions += 1
        step.preempted.append(victim.request_id)
        undone = step.entries.pop(victim.request_id, None)
        if undone is not None:
            step.budget += undone.num_tokens + undone.num_draft_tokens

    # ---- after the step ----

    def update_from_output(
        self, out: SchedulerOutput, result: StepOutput, start: float, end: float
    ) -> dict[str, list[int]]:
        """Advance the scheduled requests; return the new tokens per request (plan order).

        Records each prefill chunk, each token time (the step's end) and each verified
        proposal in the timelines, keeps accepted drafts (rolling back the blocks of rejected
        ones), and registers newly computed full blocks in the prefix cache.
        """
        new_tokens: dict[str, list[int]] = {}
        # Runs for every scheduled sequence every step: attribute lookups are hoisted.
        step_id = out.plan.step_id
        sampled = result.sampled
        cache_blocks = self.kv_cache.cache_blocks
        bs = self.kv_cache.block_size
        for e in out.entries:
            req = e.request
            rid = req.request_id
            token_ids = req.token_ids
            if e.is_prefill:
                req.timeline.chunks.append(
                    PrefillChunk(step_id, start, end, e.num_tokens, e.cached_tokens)
                )
            # Blocks become cacheable only when the computed tokens cross a block boundary;
            # every earlier full block was registered when it was crossed (or came from the
            # prefix cache), so a step that crosses none has nothing to register. That is
            # most decode steps: the call is skipped.
            blocks_before = req.num_computed_tokens // bs
            computed = req.num_computed_tokens = req.num_computed_tokens + e.num_tokens
            if computed < len(token_ids):
                # a chunk that did not reach the end of the prompt
                if computed // bs > blocks_before:
                    cache_blocks(rid, token_ids, computed)
                continue
            tokens = sampled.get(rid)
            if not tokens:
                raise RuntimeError(f"the executor returned no sampled token for request {rid!r}")
            if e.num_draft_tokens:
                self._accept_drafts(e, tokens, step_id)
            if req.spec_token_ids:
                req.spec_token_ids = []
            token_ids.extend(tokens)
            if req.num_computed_tokens // bs > blocks_before:
                cache_blocks(rid, token_ids, req.num_computed_tokens)
            req.phase = _DECODE
            tl = req.timeline
            if tl.first_token is None:
                tl.first_token = end
            if len(tokens) == 1:  # the usual case; spares building a one-item list
                tl.token_times.append(end)
            else:
                tl.token_times.extend([end] * len(tokens))
            tl.output_tokens = len(token_ids) - req.num_prompt_tokens
            new_tokens[rid] = tokens
        return new_tokens

    def _accept_drafts(self, e: ScheduledEntry, tokens: list[int], step_id: int) -> None:
        """Check the executor's verdict on the entry's drafts, record it, count the accepted
        drafts as computed and free the blocks that hold only rejected ones."""
        req = e.request
        drafts = req.spec_token_ids[: e.num_draft_tokens]
        accepted = len(tokens) - 1
        if not 0 <= accepted <= len(drafts) or tokens[:accepted] != drafts[:accepted]:
            raise RuntimeError(
                f"the executor returned {tokens} for request {req.request_id!r} with drafts "
                f"{drafts}: expected the accepted drafts followed by one token"
            )
        e.num_accepted = accepted
        req.timeline.spec.append(SpecRecord(step_id, len(drafts), accepted))
        req.num_computed_tokens += accepted
        self.kv_cache.trim(req.request_id, req.num_computed_tokens)


def _preemption_order(req: Request) -> tuple[int, int]:
    """Larger = preempted first: the lowest priority (largest value), then the latest admitted."""
    return (req.priority, req.admit_seq)
