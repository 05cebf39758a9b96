"""Bulk decode: the simulator's fast path through the pure-decode steps of a long replay.

Most steps of a replay are pure decode: the same running requests each take one token and
nothing is admitted, preempted or finished. While that holds, ``Scheduler.schedule`` would
plan the same batch again every step, so ``run_decode_burst`` (``LLMEngine.decode_burst``)
runs those steps in bulk: per step it calls the KV cache only where a request needs or fills
a block and the executor's ``execute_decodes`` for the step's time, and books the tokens,
times and counters of all the steps at once. The outcome is exactly that of calling
``LLMEngine.step`` for each (tests/test_sim_identity.py runs both). The engine's reading path
(engine, scheduler, request, plan, the plain KV cache) reaches this module only through the
one-line ``LLMEngine.decode_burst``, and this module reaches them only through their public
interfaces: the engine's ``record_decode_steps`` and ``finish_request``, the scheduler's
``reserve_step_ids``, the KV cache's calls and the requests' fields. docs/design/scheduler.md
("Bulk decode") has the conditions and why they suffice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

from servelab.engine.request import Request, RequestOutput
from servelab.vocab import FinishReason, Phase, StepRecord

if TYPE_CHECKING:
    from servelab.engine.engine import LLMEngine
    from servelab.engine.kv.kv_cache_plain import KVCache
    from servelab.engine.scheduler import Scheduler

_DECODE = Phase.DECODE


@dataclass
class DecodeBurst:
    """Steps run by ``run_decode_burst``: each of ``requests`` got one token in every one, and
    any in ``finished`` finished in the last."""

    requests: list[Request]
    ends: list[float]  # each step's end
    records: list[StepRecord]  # each step's record, when asked for
    finished: list[RequestOutput]  # the outputs of the requests the last step finished


class DecodeExecutor(Protocol):
    """An executor that runs pure-decode steps without plans, on the clock the engine reads
    (the simulator's). ``execute_decodes`` runs one step of ``num_seqs`` one-token decodes
    after ``context_tokens`` cached tokens in all, exactly as ``execute`` would that plan,
    advancing the clock; ``decode_tokens(num_output_tokens, count)`` are the tokens it
    samples for a sequence over its next ``count`` decodes, never an EOS id."""

    def execute_decodes(self, num_seqs: int, context_tokens: int) -> float: ...

    def decode_tokens(self, num_output_tokens: int, count: int) -> list[int]: ...


def run_decode_burst(
    engine: LLMEngine, horizon: float, keep_records: bool = False
) -> DecodeBurst | None:
    """Run, in bulk, ``engine``'s steps that start before ``horizon`` while they are pure
    decode of the same requests (``decode_run``), up to and including the first step that
    finishes any of them (by length: nothing else can stop them here).

    Each step is the one ``engine.step`` would run, with the same tokens, times, KV blocks,
    counters and finishes; only the per-step objects are not made: outputs only for the
    requests that finished, and step records only with ``keep_records`` (then also kept in
    ``engine.step_records``). For a caller that owns a virtual clock (the simulator) and an
    executor with ``execute_decodes``; None when the next step is not such a step, there is
    no such executor, or the engine speculates or detokenizes (stop strings).
    """
    ex = engine.executor
    if engine.spec is not None or engine.tokenizer is not None:
        return None
    if not hasattr(ex, "execute_decodes"):
        return None
    run = decode_run(engine.scheduler)
    if run is None:
        return None
    reqs = run.requests
    # Steps until each request reaches its length limit (that step finishes it). Stop
    # ids are checked per token, so a request with any has no burst; the executor's
    # tokens are never EOS.
    left: list[int] = []
    for req in reqs:
        sp = req.sampling_params
        if sp.stop_token_ids:
            return None
        limit = min(sp.max_tokens, engine.max_model_len - req.num_prompt_tokens)
        left.append(limit - (len(req.token_ids) - req.num_prompt_tokens))
    steps = min(left)
    dex = cast(DecodeExecutor, ex)
    execute, tokens = dex.execute_decodes, dex.decode_tokens
    clock, kv, n = engine.clock, engine.kv_cache, len(reqs)
    context = run.context_tokens
    starts: list[float] = []
    ends: list[float] = []
    kv_used: list[int] = []  # blocks in use as each step started, for its record
    j = 0
    start = clock()
    while j < steps:
        if start >= horizon or not run.allocate(j):
            break
        if keep_records:
            kv_used.append(kv.num_used_blocks)
        execute(n, context)
        end = clock()
        context += n
        run.computed(j, tokens)
        starts.append(start)
        ends.append(end)
        j += 1
        start = end  # only execute moves the clock: the next step starts where this one ended
    if not ends:
        return None
    run.commit(ends, tokens)
    first_id = engine.scheduler.reserve_step_ids(len(ends))
    records: list[StepRecord] = []
    if keep_records:  # nothing the records read changed since their steps ran
        decode = [r.request_id for r in reqs]
        records = engine.record_decode_steps(first_id, starts, ends, decode, kv_used)
    finished: list[RequestOutput] = []
    if j == steps:  # the last step finished these, in plan order as step's outputs are
        end = ends[-1]
        for req, k in zip(reqs, left, strict=True):
            if k == steps:
                engine.finish_request(req, FinishReason.LENGTH, end)
                finished.append(RequestOutput(req, req.token_ids[-1:], "", FinishReason.LENGTH))
    return DecodeBurst(reqs, ends, records, finished)


def decode_run(scheduler: Scheduler) -> DecodeRun | None:
    """The coming steps in bulk, if ``scheduler``'s next one is every running request
    decoding one token with nothing to admit (see :class:`DecodeRun`); None otherwise."""
    running = scheduler.running
    cfg = scheduler.config
    if not running or len(running) > cfg.max_num_batched_tokens:
        return None
    if scheduler.waiting and len(running) < cfg.max_num_seqs:
        return None
    for req in running:
        if (
            req.phase is not _DECODE
            or req.spec_token_ids
            or len(req.token_ids) - req.num_computed_tokens != 1
        ):
            return None
    return DecodeRun(scheduler.kv_cache, list(running))


class DecodeRun:
    """Steps in which the same running requests each decode one token, done in bulk.

    While nothing is admitted, preempted or finished, every step is the one ``schedule``
    would plan: each running request (all fit the token budget; admission has nothing to
    do or no seat) takes its one pending token, and ``allocate`` changes something only
    for a request whose next token starts a block. So per step this object calls the KV
    cache only where a block is needed (``allocate``) or filled (``cache_blocks``), in
    running order as ``schedule`` and ``update_from_output`` would, and :meth:`commit`
    books the tokens, times and counters of all the steps at once. The caller
    (``run_decode_burst``) ends the run with the first step that finishes a request and
    finishes it itself, and :meth:`allocate` says when a step would run short of blocks (the
    policy then preempts, which only ``schedule`` does).
    """

    def __init__(self, kv: KVCache, requests: list[Request]) -> None:
        self.requests = requests
        self._kv = kv
        bs = self._bs = kv.block_size
        self._computed = [r.num_computed_tokens for r in requests]
        self.context_tokens = sum(self._computed)
        self._num_output = [len(r.token_ids) - r.num_prompt_tokens for r in requests]
        self._booked = [0] * len(requests)  # steps whose tokens are in token_ids
        # Step j of the run needs a block for request i when its table, which covers at
        # least its computed tokens, ends at token computed + j; from then on every block
        # size steps. Likewise a block fills when computed + j + 1 reaches a multiple of it.
        # Keyed by step modulo the block size; lists in running order.
        self._alloc: dict[int, list[tuple[int, int]]] = {}
        self._fill: dict[int, list[int]] = {}
        tables = kv.block_table
        for i, req in enumerate(requests):
            c = self._computed[i]
            first = len(tables(req.request_id)) * bs - c
            self._alloc.setdefault(first % bs, []).append((i, first))
        if kv.enable_prefix_caching:
            for i, c in enumerate(self._computed):
                self._fill.setdefault((-c - 1) % bs, []).append(i)

    def allocate(self, j: int) -> bool:
        """Give step ``j`` its new blocks; False (nothing changed) if the free ones are short."""
        slot = self._alloc.get(j % self._bs)
        if slot is None:
            return True
        due = [i for i, first in slot if first <= j]
        if not due:
            return True
        kv = self._kv
        # Each takes one block and none frees any: all succeed or the policy would preempt.
        if kv.num_free_blocks < len(due):
            return False
        reqs, computed = self.requests, self._computed
        for i in due:
            kv.allocate(reqs[i].request_id, computed[i] + j + 1)
        return True

    def computed(self, j: int, tokens: Callable[[int, int], list[int]]) -> None:
        """Step ``j`` ran: register the blocks it filled. ``tokens(num_output, count)`` gives
        a request's tokens (the executor's), for the ones a filled block holds."""
        due = self._fill.get(j % self._bs)
        if due is None:
            return
        reqs, computed = self.requests, self._computed
        for i in due:
            self._book(i, j + 1, tokens)
            req = reqs[i]
            self._kv.cache_blocks(req.request_id, req.token_ids, computed[i] + j + 1)

    def _book(self, i: int, steps: int, tokens: Callable[[int, int], list[int]]) -> None:
        booked = self._booked[i]
        if steps > booked:
            self.requests[i].token_ids += tokens(self._num_output[i] + booked, steps - booked)
            self._booked[i] = steps

    def commit(self, ends: list[float], tokens: Callable[[int, int], list[int]]) -> None:
        """Book the run's ``len(ends)`` steps, which ended at ``ends``, as
        ``update_from_output`` would have after each."""
        k = len(ends)
        for i, req in enumerate(self.requests):
            self._book(i, k, tokens)
            req.num_computed_tokens = self._computed[i] + k
            tl = req.timeline
            tl.token_times += ends
            tl.output_tokens = self._num_output[i] + k
