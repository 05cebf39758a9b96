"""Scheduler policy: budget, cap, chunking, priority, preemption (driven without an executor)."""

from __future__ import annotations

from servelab.engine.batch_plan import StepOutput
from servelab.engine.engine_config import EngineConfig
from servelab.engine.kv.kv_cache import KVCacheManager
from servelab.engine.request import Request
from servelab.engine.sampling_params import SamplingParams
from servelab.engine.scheduler import Scheduler, SchedulerOutput
from servelab.vocab import FinishReason, Phase

BS = 4


def make(
    num_blocks: int = 64,
    budget: int = 16,
    max_seqs: int = 8,
    chunked: bool = True,
    caching: bool = True,
    preempt_for_priority: bool = True,
) -> Scheduler:
    cfg = EngineConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        block_size=BS,
        num_kv_blocks=num_blocks,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=caching,
        max_model_len=1024,
    )
    return Scheduler(cfg, KVCacheManager(num_blocks, BS, caching), preempt_for_priority)


def req(rid: str, n: int, prio: int = 0, max_tokens: int = 100, base: int = 0) -> Request:
    tokens = [base + i + 1 for i in range(n)]
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), [0], 0.0, prio)


def step(s: Scheduler, now: float = 0.0) -> SchedulerOutput:
    """One step with a trivial executor; finishes requests that reached max_tokens."""
    out = s.schedule(now)
    sampled = {seq.request_id: [7] for seq in out.plan.seqs if seq.sample}
    s.update_from_output(out, StepOutput(sampled), now, now + 1)
    for e in out.entries:
        r = e.request
        if r.phase is Phase.DECODE and r.num_output_tokens >= r.sampling_params.max_tokens:
            s.finish_request(r, FinishReason.LENGTH, now + 1)
    return out


def tokens_of(out: SchedulerOutput) -> dict[str, int]:
    return {e.request.request_id: e.num_tokens for e in out.entries}


def test_long_prompt_is_chunked_to_the_budget() -> None:
    s = make(budget=16)
    r = req("a", 40)
    s.add_request(r)
    outs = [step(s) for _ in range(3)]
    assert [tokens_of(o)["a"] for o in outs] == [16, 16, 8]
    assert [o.plan.seqs[0].start_pos for o in outs] == [0, 16, 32]
    assert [o.plan.seqs[0].sample for o in outs] == [False, False, True]
    assert all(o.prefill == {"a": n} for o, n in zip(outs, [16, 16, 8]))
    assert r.phase is Phase.DECODE and r.num_output_tokens == 1
    assert tokens_of(step(s)) == {"a": 1} and step(s).decode == ["a"]


def test_decodes_go_first_and_a_prefill_chunk_takes_the_rest() -> None:
    s = make(budget=16)
    s.add_request(req("d1", 3))
    s.add_request(req("d2", 3))
    step(s)  # both prefilled in one step
    s.add_request(req("p", 50))
    out = step(s)
    assert tokens_of(out) == {"d1": 1, "d2": 1, "p": 14}
    assert out.decode == ["d1", "d2"] and out.prefill == {"p": 14}
    assert tokens_of(step(s)) == {"d1": 1, "d2": 1, "p": 14}


def test_budget_and_cap_hold_every_step() -> None:
    s = make(budget=24, max_seqs=3, num_blocks=200)
    for i in range(10):
        s.add_request(req(f"r{i}", 5 + 7 * i, max_tokens=3 + i % 4, base=100 * i))
    steps = 0
    while s.has_unfinished():
        out = step(s)
        steps += 1
        assert out.plan.num_tokens <= 24
        assert len(out.entries) <= 3 and s.num_running <= 3
        assert steps < 500
    assert s.kv_cache.num_used_blocks == 0


def test_priority_overtakes_queued_batch_requests_fcfs_within_class() -> None:
    s = make(max_seqs=1)
    for i in range(3):
        s.add_request(req(f"batch{i}", 4, prio=1, max_tokens=1))
    s.add_request(req("late-batch", 4, prio=1, max_tokens=1))
    s.add_request(req("interactive", 4, prio=0, max_tokens=1))
    s.add_request(req("interactive2", 4, prio=0, max_tokens=1))
    order = [step(s).admitted[0] for _ in range(6)]
    assert order == ["interactive", "interactive2", "batch0", "batch1", "batch2", "late-batch"]


def test_out_of_blocks_preempts_most_recently_admitted() -> None:
    s = make(num_blocks=4, budget=32)
    a, b = req("a", 7), req("b", 7, base=50)
    s.add_request(a)
    s.add_request(b)
    step(s)  # both prefilled: 2 blocks each, pool full
    step(s)  # decode computes position 7: still 2 blocks each
    out = step(s)  # position 8 needs a third block for a
    assert out.preempted == ["b"]
    assert tokens_of(out) == {"a": 1}
    assert b.phase is Phase.QUEUED and b.num_computed_tokens == 0
    assert b.num_output_tokens == 2  # output kept, to be recomputed
    assert len(b.timeline.preemptions) == 1 and len(b.timeline.queued) == 2
    assert s.num_preemptions == 1
    s.kv_cache.check_invariants()


def test_out_of_blocks_preempts_lowest_priority_first() -> None:
    s = make(num_blocks=6, budget=32)
    low = req("low", 7, prio=1)
    s.add_request(low)
    step(s)  # low admitted first
    s.add_request(req("x", 7, base=30))
    s.add_request(req("y", 7, base=60))
    step(s)  # x, y admitted after it; pool full
    out = step(s)  # low needs a third block
    assert out.preempted == ["low"]
    assert set(tokens_of(out)) == {"x", "y"}


def test_preempted_request_goes_to_the_front_and_is_recomputed_with_its_output() -> None:
    s = make(num_blocks=4, budget=32, max_seqs=2)
    a, b = req("a", 7, max_tokens=4), req("b", 7, base=50)
    s.add_request(a)
    s.add_request(b)
    s.add_request(req("c", 3, base=90))  # waits: cap of 2
    step(s)
    step(s)
    out = step(s)
    assert out.preempted == ["b"] and out.admitted == []  # no admission in a preempting step
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    while "a" in [r.request_id for r in s.running]:
        step(s)
    out = s.schedule(0.0)
    assert out.admitted[0] == "b"
    seq = next(q for q in out.plan.seqs if q.request_id == "b")
    cached = out.entries[0].cached_tokens
    assert seq.start_pos == cached
    assert seq.token_ids == b.token_ids[cached:]  # prompt + kept output
    assert seq.sample and seq.num_output_tokens == 2


def test_high_priority_arrival_preempts_lower_priority_when_out_of_blocks() -> None:
    s = make(num_blocks=4, budget=32)
    s.add_request(req("batch", 15, prio=1))
    step(s)  # 4 blocks in use
    s.add_request(req("urgent", 5, prio=0, base=40))
    out = step(s)
    assert out.preempted == ["batch"] and out.admitted == ["urgent"]
    assert tokens_of(out) == {"urgent": 5}


def test_equal_priority_arrival_waits_for_blocks() -> None:
    s = make(num_blocks=4, budget=32)
    s.add_request(req("first", 15))
    step(s)
    s.add_request(req("second", 5, base=40))
    out = step(s)
    assert out.preempted == [] and out.admitted == []


def test_priority_preemption_can_be_switched_off() -> None:
    s = make(num_blocks=4, budget=32, preempt_for_priority=False)
    s.add_request(req("batch", 15, prio=1))
    step(s)
    s.add_request(req("urgent", 5, prio=0, base=40))
    assert step(s).preempted == []


def test_no_chunking_prefills_whole_or_waits() -> None:
    s = make(budget=16, chunked=False)
    s.add_request(req("d", 3))
    step(s)
    s.add_request(req("fits", 15, base=20))  # 1 decode + 15 = 16
    s.add_request(req("too-big-now", 10, base=40))
    out = step(s)
    assert tokens_of(out) == {"d": 1, "fits": 15}
    out = step(s)
    assert tokens_of(out) == {"d": 1, "fits": 1, "too-big-now": 10}


def test_no_chunking_runs_a_prompt_longer_than_the_budget_alone() -> None:
    s = make(budget=16, chunked=False)
    s.add_request(req("d", 3))
    step(s)
    s.add_request(req("long", 40, base=20))
    out = step(s)
    assert tokens_of(out) == {"long": 40}  # the decode pauses for this one step
    assert out.plan.seqs[0].sample
    assert tokens_of(step(s)) == {"d": 1, "long": 1}


def test_prefix_hit_on_admission_skips_cached_tokens() -> None:
    s = make(budget=64)
    shared = req("a", 13, max_tokens=1)
    s.add_request(shared)
    step(s)  # a computes 13 tokens; 3 full blocks get cached
    b = req("b", 13, max_tokens=1)
    b.token_ids[-1] = b.prompt_token_ids[-1] = 999  # same first 12 tokens
    s.add_request(b)
    out = step(s)
    assert out.entries[0].cached_tokens == 12 and tokens_of(out) == {"b": 1}
    assert b.timeline.cached_tokens == 12
    assert s.kv_cache.prefix_cache_hits == 12


def test_finish_request_frees_blocks_in_any_phase() -> None:
    s = make(budget=8)
    a, b, c = req("a", 20), req("b", 3, base=30), req("c", 3, base=60)
    for r in (a, b, c):
        s.add_request(r)
    step(s)  # a mid-prefill; b, c waiting
    assert a.phase is Phase.PREFILL
    s.finish_request(a, FinishReason.ABORT, 1.0)
    s.finish_request(c, FinishReason.ABORT, 1.0)  # while queued
    step(s)
    step(s)  # b decoding
    s.finish_request(b, FinishReason.ABORT, 2.0)
    assert not s.has_unfinished()
    assert s.kv_cache.num_used_blocks == 0
    s.kv_cache.check_invariants()
    assert a.timeline.finish_reason is FinishReason.ABORT and a.timeline.finished == 1.0
