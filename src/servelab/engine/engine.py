"""The engine: requests in, one step at a time, tokens and timelines out.

``LLMEngine`` ties the scheduler and KV-cache policy to an executor (the torch model runner,
or the simulator's cost model). It validates requests, runs steps, decides when each request
is finished (EOS, stop ids, stop strings, max_tokens, the context limit), detokenizes
incrementally, and keeps every request's timeline and every step's record.

Speculative decoding (``config.speculative_config``, or a ``proposer``): each step first
asks the proposer for drafts for the decoding requests (``servelab.engine.spec``); the
scheduler verifies them in the same step and the step record counts what was proposed and
accepted. Without it nothing here changes.

Clock: every timestamp comes from ``clock()`` (the simulator passes a virtual clock that its
executor advances inside ``execute``); nothing here reads the wall clock itself.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from servelab.engine.decode_burst import DecodeBurst, run_decode_burst
from servelab.engine.detokenizer import Detokenizer
from servelab.engine.engine_config import EngineConfig
from servelab.engine.engine_stats import EngineStats
from servelab.engine.executor import Executor
from servelab.engine.kv.finished_scope import FinishedScopeKVCache, PlainFinishedScopeKVCache
from servelab.engine.kv.kv_cache import KVCacheManager
from servelab.engine.kv.kv_cache_plain import KVCache, PlainKVCache
from servelab.engine.request import Request, RequestOutput
from servelab.engine.sampling_params import SamplingParams
from servelab.engine.scheduler import Scheduler, SchedulerOutput
from servelab.engine.validation import check_limits, valid_prompt_ids
from servelab.vocab import COLOCATED, FinishReason, RequestTimeline, StepRecord

if TYPE_CHECKING:
    from servelab.engine.detokenizer import TextTokenizer
    from servelab.engine.spec.decoder import SpeculativeDecoder
    from servelab.engine.spec.proposer import Proposer

log = logging.getLogger(__name__)


@dataclass
class EngineStepResult:
    outputs: list[RequestOutput]
    record: StepRecord | None  # None when nothing ran


def _kv_cache(config: EngineConfig, num_blocks: int) -> KVCache:
    """The cache ``config`` names: fast or plain, fed by every request or finished ones."""
    plain = config.kv_cache == "plain"
    if config.prefix_cache_scope == "finished":
        cls: type[KVCache] = PlainFinishedScopeKVCache if plain else FinishedScopeKVCache
    else:
        cls = PlainKVCache if plain else KVCacheManager
    return cls(num_blocks, config.block_size, config.enable_prefix_caching)


class LLMEngine:
    """A continuous-batching engine over an ``Executor``.

    Contract:
    - ``add_request`` validates (clear ``ValueError``s) and queues; ``step`` runs one batch and
      returns an output for every request that got tokens or finished in it; ``abort`` frees a
      request's KV blocks at once.
    - Finished requests' timelines and every step record are kept in bounded deques
      (``finished_timelines``, ``step_records``, newest last) for ``/v1/timelines``.
    - Once no request is unfinished, every KV block has reference count 0.
    - ``proposer`` (optional) replaces the proposer that ``config.speculative_config`` names
      (EAGLE-style heads, tests); it needs a speculative config for the draft count.
    - ``decode_burst`` (the simulator's) runs the coming pure-decode steps in bulk with the
      same outcome as calling ``step`` for each, through ``record_step`` and
      ``finish_request``, as ``step`` does.
    """

    def __init__(
        self,
        executor: Executor,
        config: EngineConfig,
        tokenizer: TextTokenizer | None = None,
        clock: Callable[[], float] = time.monotonic,
        history: int = 10_000,
        proposer: Proposer | None = None,
    ) -> None:
        self.executor = executor
        self.tokenizer = tokenizer
        self.clock = clock
        self.config, self.max_model_len, self.num_kv_blocks = config.resolve(executor)
        spec = self.config.speculative()
        if proposer is not None and spec is None:
            raise ValueError(
                "a proposer needs speculative_config (at least num_speculative_tokens), e.g. "
                '{"method": "ngram", "num_speculative_tokens": 4}'
            )
        self.kv_cache: KVCache = _kv_cache(self.config, self.num_kv_blocks)
        self.scheduler = Scheduler(self.config, self.kv_cache)
        executor.allocate_kv(self.num_kv_blocks, self.config.block_size)
        self._requests: dict[str, Request] = {}
        self._detok: dict[str, Detokenizer] = {}
        self._eos = list(executor.eos_token_ids)
        self._vocab_size: int | None = getattr(executor, "vocab_size", None) or (
            tokenizer.vocab_size if tokenizer is not None else None
        )
        # Which engine of a deployment this is (a simulated replica, a disaggregated worker);
        # stamped on every step record and timeline.
        self.replica = 0
        self.role = COLOCATED
        self.finished_timelines: deque[RequestTimeline] = deque(maxlen=history)
        self.step_records: deque[StepRecord] = deque(maxlen=history)
        self.spec: SpeculativeDecoder | None = None
        if spec is not None:
            from servelab.engine.spec.factory import build_decoder

            self.spec = build_decoder(spec, executor, self.config, proposer)

    # ---- requests ----

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        sampling_params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. ``prompt_token_ids`` win over ``prompt`` when both are given.

        Raises ValueError: duplicate id, empty prompt, bad token ids, stop strings without a
        tokenizer, or prompt + max_tokens beyond the context or the KV pool.
        """
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use; use a unique id")
        sp = sampling_params or SamplingParams()
        ids = valid_prompt_ids(prompt, prompt_token_ids, self.tokenizer, self._vocab_size)
        check_limits(len(ids), sp, self.max_model_len, self.kv_cache, self.tokenizer is not None)
        now = self.clock() if arrival_time is None else arrival_time
        req = Request(request_id, ids, sp, self._eos, now, priority)
        req.timeline.replica, req.timeline.role = self.replica, self.role
        self._requests[request_id] = req
        if self.tokenizer is not None:
            self._detok[request_id] = Detokenizer(self.tokenizer, ids, sp.stop)
        self.scheduler.add_request(req)

    def abort(self, request_id: str) -> bool:
        """Finish the request with ABORT and free its KV blocks now; False if unknown/finished."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self.finish_request(req, FinishReason.ABORT, self.clock())
        return True

    def finish_request(self, req: Request, reason: FinishReason, now: float) -> None:
        """Finish ``req``, a request of this engine not finished yet, at ``now`` with
        ``reason``: the scheduler drops it and frees its KV blocks, its timeline is closed
        and kept in ``finished_timelines``, and the engine forgets it (detokenizer, drafts)."""
        self.scheduler.finish_request(req, reason, now)
        if self.spec is not None:
            self.spec.finished(req.request_id)
        del self._requests[req.request_id]
        self._detok.pop(req.request_id, None)
        self.finished_timelines.append(req.timeline)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    def get_request(self, request_id: str) -> Request | None:
        """The live state of an unfinished request; None once it finished or if unknown. Read
        it; only the hooks below change it (a disaggregated hand-off)."""
        return self._requests.get(request_id)

    def get_timeline(self, request_id: str) -> RequestTimeline | None:
        """The live timeline of an unfinished request, or a kept finished one."""
        req = self._requests.get(request_id)
        if req is not None:
            return req.timeline
        return next(
            (t for t in reversed(self.finished_timelines) if t.request_id == request_id), None
        )

    def stats(self) -> EngineStats:
        return EngineStats.of(self.kv_cache, self.scheduler)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache.reset_prefix_cache()

    # ---- stepping ----

    def step(self) -> EngineStepResult:
        """Schedule and run one batch; return the outputs and the step record."""
        if not self.scheduler.has_unfinished():
            return EngineStepResult([], None)
        start = self.clock()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        out = self.scheduler.schedule(start)
        if self.spec is not None:
            for rid in out.preempted:
                self.spec.preempted(rid)
        if not out.entries:
            return EngineStepResult([], None)
        kv_used = self.kv_cache.num_used_blocks
        try:
            result = self.executor.execute(out.plan)
        except Exception as e:  # fail this batch's requests, keep serving
            log.exception("step %d failed", out.plan.step_id)
            return EngineStepResult(self._fail_batch(out, e), None)
        end = self.clock()
        new_tokens = self.scheduler.update_from_output(out, result, start, end)
        speculated: list = []  # only the speculative decoder gives requests drafts
        if self.spec is not None:
            speculated = [e for e in out.entries if e.num_draft_tokens]
            for entry in speculated:
                self.spec.observe(
                    entry.request.request_id, entry.num_draft_tokens, entry.num_accepted
                )
        requests, emit = self._requests, self._emit
        outputs = [emit(requests[rid], tokens, end) for rid, tokens in new_tokens.items()]
        prefill, decode = out.prefill_and_decode()
        record = self.record_step(
            out.plan.step_id,
            start,
            end,
            prefill,
            decode,
            kv_used,
            list(out.preempted),
            sum(e.num_draft_tokens for e in speculated) if speculated else 0,
            sum(e.num_accepted for e in speculated) if speculated else 0,
        )
        return EngineStepResult(outputs, record)

    def decode_burst(self, horizon: float, keep_records: bool = False) -> DecodeBurst | None:
        """The simulator's fast path: the coming pure-decode steps in bulk, with the outcome of
        a ``step`` for each (``engine/decode_burst.py``); None when the next step is not one."""
        return run_decode_burst(self, horizon, keep_records)

    def record_step(
        self,
        step_id: int,
        start: float,
        end: float,
        prefill: dict[str, int],
        decode: list[str],
        kv_used: int,
        preempted: list[str],
        spec_proposed: int = 0,
        spec_accepted: int = 0,
    ) -> StepRecord:
        """Keep (in ``step_records``) and return the record of step ``step_id``, which ran
        from ``start`` to ``end``: ``prefill`` tokens per prefilling request and the
        ``decode`` requests (plan order), ``kv_used`` blocks in use when it started, the
        requests it ``preempted`` and the drafts it verified. The queue length, pool size,
        replica and role are read now: call it once the step's requests are updated."""
        record = StepRecord(
            step_id=step_id,
            start=start,
            end=end,
            prefill_tokens=sum(prefill.values()),
            decode_seqs=len(decode),
            prefill=prefill,
            decode=decode,
            spec_proposed=spec_proposed,
            spec_accepted=spec_accepted,
            kv_blocks_used=kv_used,
            kv_blocks_total=self.kv_cache.num_blocks,
            num_waiting=self.num_waiting,
            preempted=preempted,
            replica=self.replica,
            role=self.role,
        )
        self.step_records.append(record)
        return record

    def record_decode_steps(
        self,
        first_id: int,
        starts: list[float],
        ends: list[float],
        decode: list[str],
        kv_used: list[int],
    ) -> list[StepRecord]:
        """``record_step`` of each of the pure-decode steps ``first_id``, ``first_id + 1``, ...
        (a decode burst's), step ``i`` running from ``starts[i]`` to ``ends[i]`` with
        ``kv_used[i]`` blocks in use, each decoding the requests ``decode``: the same records,
        kept the same way, with what they share read once (call it when ``record_step`` of
        each could be called)."""
        total, waiting = self.kv_cache.num_blocks, self.num_waiting
        replica, role, n = self.replica, self.role, len(decode)
        # positional arguments, the cheaper call: the test against record_step would catch a
        # change of StepRecord's field order
        records = [
            StepRecord(i, s, e, 0, n, {}, decode.copy(), 0, 0, u, total, waiting, [], replica, role)
            for i, s, e, u in zip(
                range(first_id, first_id + len(ends)), starts, ends, kv_used, strict=True
            )
        ]
        self.step_records.extend(records)
        return records

    def _emit(self, req: Request, tokens: list[int], now: float) -> RequestOutput:
        """Apply the stop rules to this step's new tokens and build the request's output."""
        sp = req.sampling_params
        detok = self._detok.get(req.request_id)
        n_prompt, n_new = req.num_prompt_tokens, len(tokens)
        n_out = len(req.token_ids) - n_prompt - n_new  # output tokens before this step
        # Finished by length at max_tokens or when prompt + output fill the context.
        length_limit = min(sp.max_tokens, self.max_model_len - n_prompt)
        reason: FinishReason | None = None
        if n_new == 1 and detok is None:
            # The usual step without a tokenizer (the simulator): the rules below for one token.
            tok = tokens[0]
            n_out += 1
            if n_out >= sp.min_tokens and (
                tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self._eos)
            ):
                reason = FinishReason.STOP
            elif n_out >= length_limit:
                reason = FinishReason.LENGTH
            if reason is not None:
                self.finish_request(req, reason, now)
            return RequestOutput(req, [tok], "", reason)
        kept = 0
        for tok in tokens:
            kept += 1
            n_out += 1
            check = n_out >= sp.min_tokens  # vLLM: no stop rule applies before min_tokens
            if check and (tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self._eos)):
                reason = FinishReason.STOP  # the stop token's text is not output
                break
            if detok is not None and detok.add(tok, check):
                reason = FinishReason.STOP
                break
            if n_out >= length_limit:
                reason = FinishReason.LENGTH
                break
        if kept < n_new:  # tokens after a stop (speculative decoding) are dropped
            drop = n_new - kept
            del req.token_ids[-drop:]
            del req.timeline.token_times[-drop:]
            tokens = tokens[:kept]
        text = detok.take(final=reason is not None) if detok is not None else ""
        if reason is not None:
            self.finish_request(req, reason, now)
        return RequestOutput(req, list(tokens), text, reason)

    def _fail_batch(self, out: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        now = self.clock()
        outputs = []
        for e in out.entries:
            req = e.request
            req.timeline.error = f"{type(error).__name__}: {error}"
            self.finish_request(req, FinishReason.ERROR, now)
            outputs.append(RequestOutput(req, [], "", FinishReason.ERROR))
        return outputs

    # ---- hooks for a request that lives on more than one engine (disaggregated serving) ----

    def detokenizer(self, request_id: str) -> Detokenizer | None:
        """The request's incremental detokenizer (None without a tokenizer)."""
        return self._detok.get(request_id)

    def end_request(self, request_id: str, reason: FinishReason) -> None:
        """Finish ``request_id`` now with ``reason`` (blocks freed, timeline kept)."""
        req = self._requests.get(request_id)
        if req is not None:
            self.finish_request(req, reason, self.clock())

    def forget_request(self, request_id: str) -> Request | None:
        """Drop a request that goes on elsewhere (its timeline with it) and free its blocks."""
        req = self._requests.pop(request_id, None)
        self._detok.pop(request_id, None)
        if req is not None and self.spec is not None:  # forget any per-request draft state
            self.spec.finished(request_id)
        self.kv_cache.free(request_id)
        return req
