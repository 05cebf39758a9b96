"""LLMEngine on a deterministic fake executor: outputs, stop rules, timelines, invariants."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from engine_fakes import EOS, FakeClock, FakeExecutor, FakeTokenizer, reference_generate
from hypothesis import given, settings

from servelab.engine.engine import LLMEngine
from servelab.engine.engine_config import EngineConfig
from servelab.engine.request import RequestOutput
from servelab.engine.sampling_params import SamplingParams
from servelab.model.llm import LLM
from servelab.vocab import FinishReason

VOCAB = 1000
MODEL_LEN = 512


def engine(tokenizer: FakeTokenizer | None = None, history: int = 10_000, **cfg) -> LLMEngine:
    cfg.setdefault("block_size", 4)
    cfg.setdefault("num_kv_blocks", 256)
    clock = FakeClock()
    ex = FakeExecutor(vocab_size=VOCAB, max_model_len=MODEL_LEN, clock=clock)
    return LLMEngine(ex, EngineConfig(**cfg), tokenizer=tokenizer, clock=clock, history=history)


def prompts(n: int, shared: int = 0) -> list[list[int]]:
    """n prompts of varied length; the first ``shared`` tokens are common to all."""
    head = [900 + i % 50 for i in range(shared)]
    return [head + [(37 * i + 11 * j) % 999 + 1 for j in range(3 + 9 * i % 41)] for i in range(n)]


def run_all(e: LLMEngine, reqs: list[list[int]], sp: SamplingParams) -> dict[str, list[int]]:
    for i, p in enumerate(reqs):
        e.add_request(f"r{i}", prompt_token_ids=p, sampling_params=sp)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(reqs))}
    while e.has_unfinished():
        for o in e.step().outputs:
            out[o.request_id] += o.new_token_ids
    return out


SP = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.mark.parametrize(
    "cfg",
    [
        {},  # batched, chunked, prefix caching
        {"max_num_batched_tokens": 7},  # small chunks
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 16},
        {"enable_prefix_caching": False},
        {"num_kv_blocks": 24, "max_num_batched_tokens": 32},  # preemption
        {"max_num_seqs": 1},
    ],
)
def test_outputs_match_the_reference_under_any_batching(cfg: dict) -> None:
    reqs = prompts(10, shared=9)
    e = engine(**cfg)
    got = run_all(e, reqs, SP)
    want = {f"r{i}": reference_generate(p, SP, VOCAB, MODEL_LEN) for i, p in enumerate(reqs)}
    assert got == want
    assert e.kv_cache.num_used_blocks == 0
    e.kv_cache.check_invariants()
    if cfg.get("num_kv_blocks") == 24:
        assert e.stats().num_preemptions > 0


def test_prefix_cache_hit_shows_skipped_tokens_and_changes_nothing() -> None:
    e = engine(block_size=4)
    p = list(range(1, 30))
    e.add_request("first", prompt_token_ids=p, sampling_params=SP)
    while e.has_unfinished():
        e.step()
    e.add_request("second", prompt_token_ids=p, sampling_params=SP)
    outs: list[RequestOutput] = []
    while e.has_unfinished():
        outs += e.step().outputs
    tl = outs[-1].timeline
    assert tl.cached_tokens == 28 and tl.chunks[0].cached_tokens == 28
    assert tl.chunks[0].tokens == 1
    assert sum(len(o.new_token_ids) for o in outs) == 12
    assert [t for o in outs for t in o.new_token_ids] == reference_generate(p, SP, VOCAB, MODEL_LEN)
    st_ = e.stats()
    assert (st_.prefix_cache_queries, st_.prefix_cache_hits) == (58, 28)


def test_eos_stops_and_min_tokens_bans_it() -> None:
    # Find a prompt whose greedy continuation hits EOS early, via the reference model.
    sp_free = SamplingParams(max_tokens=200)
    p = next(
        [i, j]
        for i in range(1, 200)
        for j in range(1, 200)
        if len(reference_generate([i, j], sp_free, VOCAB, MODEL_LEN)) < 3
    )
    e = engine()
    got = run_all(e, [p], sp_free)["r0"]
    assert got[-1] == EOS and len(got) < 3
    assert e.finished_timelines[-1].finish_reason is FinishReason.STOP
    sp_min = SamplingParams(max_tokens=200, min_tokens=5)
    got = run_all(engine(), [p], sp_min)["r0"]
    assert EOS not in got[:5] and len(got) > 5
    assert got == reference_generate(p, sp_min, VOCAB, MODEL_LEN)
    sp_ignore = SamplingParams(max_tokens=6, ignore_eos=True)
    e = engine()
    got = run_all(e, [p], sp_ignore)["r0"]
    assert len(got) == 6 and EOS in got
    assert e.finished_timelines[-1].finish_reason is FinishReason.LENGTH


def test_stop_token_ids_end_the_request() -> None:
    p = [5, 6, 7]
    free = reference_generate(p, SamplingParams(max_tokens=10), VOCAB, MODEL_LEN)
    stop_at = free[3]
    got = run_all(engine(), [p], SamplingParams(max_tokens=10, stop_token_ids=[stop_at]))["r0"]
    assert got == free[: free.index(stop_at) + 1]


def test_context_limit_is_checked_and_max_tokens_ends_with_length() -> None:
    e = engine(max_model_len=40)
    with pytest.raises(ValueError, match=r"exceeds the context of 40 tokens.*at most 10"):
        e.add_request(
            "x", prompt_token_ids=list(range(1, 31)), sampling_params=SamplingParams(max_tokens=11)
        )
    with pytest.raises(ValueError, match="shorten the prompt"):
        e.add_request("y", prompt_token_ids=list(range(1, 41)))
    e.add_request(
        "z",
        prompt_token_ids=list(range(1, 31)),
        sampling_params=SamplingParams(max_tokens=10, ignore_eos=True),
    )
    outs = []
    while e.has_unfinished():
        outs += e.step().outputs
    assert outs[-1].finish_reason is FinishReason.LENGTH and outs[-1].num_output_tokens == 10


def test_bad_requests_raise_clear_errors() -> None:
    e = engine()
    with pytest.raises(ValueError, match="empty"):
        e.add_request("a", prompt_token_ids=[])
    with pytest.raises(ValueError, match="no tokenizer"):
        e.add_request("a", prompt="hello")
    with pytest.raises(ValueError, match="invalid ids"):
        e.add_request("a", prompt_token_ids=[1, VOCAB + 5])
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        e.add_request("a", prompt_token_ids=[1], sampling_params=SamplingParams(stop=["x"]))
    e.add_request("a", prompt_token_ids=[1])
    with pytest.raises(ValueError, match="already in use"):
        e.add_request("a", prompt_token_ids=[2])
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=-1)
    small = engine(num_kv_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="KV blocks but the pool has 4"):
        small.add_request(
            "b", prompt_token_ids=[1] * 10, sampling_params=SamplingParams(max_tokens=10)
        )
    with pytest.raises(ValueError, match="exceeds the model's context"):
        engine(max_model_len=MODEL_LEN + 1)


def test_stop_strings_are_trimmed_and_never_partly_sent() -> None:
    tok = FakeTokenizer(VOCAB)
    p = [3, 4, 5]
    free = reference_generate(p, SamplingParams(max_tokens=40, ignore_eos=True), VOCAB, MODEL_LEN)
    full = tok.decode(free)
    # A stop string spanning a token boundary, found well inside the text.
    i = next(k for k in range(4, len(full) - 3) if full[k] != full[k + 1])
    stop = full[i : i + 3]
    cut = full.find(stop)
    e = engine(tokenizer=tok)
    e.add_request(
        "s",
        prompt_token_ids=p,
        sampling_params=SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]),
    )
    pieces: list[str] = []
    outs: list[RequestOutput] = []
    while e.has_unfinished():
        for o in e.step().outputs:
            pieces.append(o.new_text)
            outs.append(o)
            sent = "".join(pieces)
            assert stop not in sent
    assert "".join(pieces) == full[:cut]
    assert outs[-1].finish_reason is FinishReason.STOP
    # The token that completed the stop string is the last one returned.
    n = len(outs[-1].timeline.token_times)
    assert tok.decode(free[: n - 1]).find(stop) == -1 and tok.decode(free[:n]).find(stop) == cut


def test_held_back_text_is_flushed_when_the_request_ends_otherwise() -> None:
    tok = FakeTokenizer(VOCAB)
    p = [3, 4, 5]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    full = tok.decode(reference_generate(p, sp, VOCAB, MODEL_LEN))
    # A stop string that starts with the text's last character but never completes.
    stop = full[-1] + "\x00never"
    e = engine(tokenizer=tok)
    e.add_request(
        "s",
        prompt_token_ids=p,
        sampling_params=SamplingParams(max_tokens=6, ignore_eos=True, stop=[stop]),
    )
    outs: list[RequestOutput] = []
    while e.has_unfinished():
        outs += e.step().outputs
    assert "".join(o.new_text for o in outs) == full
    assert outs[-1].finish_reason is FinishReason.LENGTH


def test_timeline_and_step_records_follow_the_virtual_clock() -> None:
    e = engine(max_num_batched_tokens=8)
    e.add_request(
        "a",
        prompt_token_ids=list(range(1, 21)),
        sampling_params=SamplingParams(max_tokens=3, ignore_eos=True),
        arrival_time=0.0,
    )
    records = []
    while e.has_unfinished():
        records.append(e.step().record)
    tl = e.get_timeline("a")
    assert tl is not None and tl.finish_reason is FinishReason.LENGTH
    assert tl.queued == [0.0] and tl.scheduled == [0.0]
    assert [c.tokens for c in tl.chunks] == [8, 8, 4]
    assert [c.step_id for c in tl.chunks] == [0, 1, 2]
    # Each step: 10 ms + 1 ms per token on the fake clock.
    assert [r.end - r.start for r in records] == pytest.approx([0.018, 0.018, 0.014, 0.011, 0.011])
    assert tl.first_token == pytest.approx(records[2].end)
    assert tl.token_times == pytest.approx([records[2].end, records[3].end, records[4].end])
    assert tl.finished == pytest.approx(records[4].end)
    assert tl.prefill_time == pytest.approx(0.05) and tl.decode_time == pytest.approx(0.022)
    assert records[0].prefill == {"a": 8} and records[3].decode == ["a"]
    assert records[3].prefill_tokens == 0 and records[3].decode_seqs == 1
    # Blocks are allocated chunk by chunk: 8, 16, 20 tokens, then position 20.
    assert [r.kv_blocks_used for r in records] == [2, 4, 5, 6, 6]
    assert records[0].kv_blocks_total == 256
    assert list(e.step_records) == records


def test_preemption_is_recorded_in_timeline_and_step() -> None:
    e = engine(num_kv_blocks=6, block_size=4, max_num_batched_tokens=64)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    for i in range(3):
        e.add_request(f"r{i}", prompt_token_ids=[i + 1] * 7, sampling_params=sp)
    preempted: list[str] = []
    while e.has_unfinished():
        rec = e.step().record
        preempted += rec.preempted
        assert rec.num_waiting == e.num_waiting
    assert preempted
    tl = e.get_timeline(preempted[0])
    assert len(tl.preemptions) >= 1 and len(tl.queued) == 1 + len(tl.preemptions)
    assert len(tl.scheduled) == 1 + len(tl.preemptions)
    assert tl.output_tokens == 8 and len(tl.token_times) == 8


def test_abort_frees_blocks_in_every_phase() -> None:
    e = engine(max_num_batched_tokens=8, max_num_seqs=2)
    sp = SamplingParams(max_tokens=50, ignore_eos=True)
    for rid in ("decoding", "prefilling", "queued"):
        e.add_request(
            rid,
            prompt_token_ids=list(range(1, 30)) if rid == "prefilling" else [3, 4],
            sampling_params=sp,
        )
    e.step()
    e.step()
    assert e.get_request("prefilling").num_computed_tokens < 29
    assert e.get_request("decoding").num_output_tokens >= 1
    assert e.get_request("queued").num_computed_tokens == 0
    assert e.abort("prefilling") and e.abort("queued")
    assert not e.abort("queued") and not e.abort("nope")
    e.step()
    e.step()
    assert e.abort("decoding")
    assert not e.has_unfinished() and e.stats().kv_blocks_used == 0
    e.kv_cache.check_invariants()
    reasons = {t.request_id: t.finish_reason for t in e.finished_timelines}
    assert set(reasons.values()) == {FinishReason.ABORT} and len(reasons) == 3


def test_executor_failure_fails_the_batch_and_frees_its_blocks() -> None:
    e = engine()
    e.executor.fail_on_step = 1
    e.add_request("a", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=5))
    e.step()
    res = e.step()
    assert res.record is None
    assert [o.finish_reason for o in res.outputs] == [FinishReason.ERROR]
    assert "injected executor failure" in res.outputs[0].timeline.error
    assert not e.has_unfinished() and e.stats().kv_blocks_used == 0


def test_history_is_bounded() -> None:
    e = engine(history=3, max_num_batched_tokens=8)
    run_all(e, prompts(5), SamplingParams(max_tokens=2))
    assert e.step_records[-1].step_id > 3
    assert len(e.finished_timelines) == 3 and len(e.step_records) == 3


def test_kv_pool_is_sized_from_memory_and_capped() -> None:
    e = engine(num_kv_blocks=None, kv_cache_memory_gb=1e-6, block_size=4)
    assert e.config.num_kv_blocks == 1000 // 256  # 256 bytes per fake block
    e = engine(num_kv_blocks=None, kv_cache_memory_gb=10.0, block_size=16, max_num_seqs=2)
    assert e.config.num_kv_blocks == 2 * MODEL_LEN // 16
    with pytest.raises(ValueError, match="holds no KV block"):
        engine(num_kv_blocks=None, kv_cache_memory_gb=1e-9)


def test_llm_generate_returns_results_in_prompt_order() -> None:
    llm = LLM.from_engine(engine(tokenizer=FakeTokenizer(VOCAB)))
    reqs = prompts(4)
    res = llm.generate(reqs, [SamplingParams(max_tokens=k + 1, ignore_eos=True) for k in range(4)])
    assert [len(r.token_ids) for r in res] == [1, 2, 3, 4]
    assert [r.prompt_token_ids for r in res] == reqs
    assert res[2].text == FakeTokenizer(VOCAB).decode(res[2].token_ids)
    assert all(r.finish_reason is FinishReason.LENGTH for r in res)
    with pytest.raises(ValueError, match="2 SamplingParams for 4 prompts"):
        llm.generate(reqs, [SamplingParams()] * 2)


# ---- property-based: random add / step / abort sequences ----

actions = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(1, 40),
            st.integers(1, 8),
            st.integers(0, 2),
            st.integers(0, 2),
        ),
        st.tuples(st.just("step"), st.integers(1, 3)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(
    acts=actions,
    budget=st.integers(4, 40),
    seqs=st.integers(1, 6),
    blocks=st.integers(14, 40),
    chunked=st.booleans(),
    caching=st.booleans(),
)
def test_random_workloads_keep_every_invariant(
    acts: list[tuple], budget: int, seqs: int, blocks: int, chunked: bool, caching: bool
) -> None:
    e = engine(
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        num_kv_blocks=blocks,
        block_size=4,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=caching,
    )
    added: dict[str, tuple[list[int], SamplingParams]] = {}
    got: dict[str, list[int]] = {}
    aborted: set[str] = set()

    def do_step() -> None:
        res = e.step()
        if res.record is None:
            return
        plan = e.executor.plans[-1]
        assert plan.num_tokens <= budget or len(plan.seqs) == 1  # oversized prompts run alone
        assert len(plan.seqs) <= seqs and e.num_running <= seqs
        e.kv_cache.check_invariants()
        for o in res.outputs:
            got[o.request_id] += o.new_token_ids

    for act in acts:
        if act[0] == "add":
            _, n, max_tokens, prio, prefix = act
            rid = f"q{len(added)}"
            p = [800 + prefix] * (4 * prefix) + [(n * 7 + k) % 997 + 1 for k in range(n)]
            sp = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens // 3)
            e.add_request(rid, prompt_token_ids=p, sampling_params=sp, priority=prio)
            added[rid] = (p, sp)
            got[rid] = []
        elif act[0] == "step":
            for _ in range(act[1]):
                do_step()
        else:
            rid = f"q{act[1]}"
            if e.abort(rid):
                aborted.add(rid)
    steps = 0
    while e.has_unfinished():
        do_step()
        steps += 1
        assert steps < 2000, "no progress"
    assert e.stats().kv_blocks_used == 0
    assert e.kv_cache.num_free_blocks == blocks
    for rid, (p, sp) in added.items():
        if rid not in aborted:
            assert got[rid] == reference_generate(p, sp, VOCAB, MODEL_LEN), rid


@pytest.mark.parametrize("chunked", [True, False])
def test_the_plain_kv_cache_runs_the_engine_to_the_same_outputs(chunked: bool) -> None:
    """``kv_cache="plain"`` and the fast default give the same outputs, timelines, step
    records and counters on shared prefixes, chunked prefill and preemption (the fake
    executor reads every token back through the block tables, so a different block would
    change the tokens too)."""
    runs = {}
    for kind in ("fast", "plain"):
        e = engine(
            kv_cache=kind,
            num_kv_blocks=40,
            max_num_seqs=8,
            max_num_batched_tokens=16 if chunked else 64,
            enable_chunked_prefill=chunked,
        )
        for i, p in enumerate(prompts(16, shared=13)):
            sp = SamplingParams(max_tokens=6 + 5 * (i % 4))
            e.add_request(f"r{i}", prompt_token_ids=p, sampling_params=sp, priority=i % 3)
        outputs: list[RequestOutput] = []
        while e.has_unfinished():
            outputs += e.step().outputs
        e.kv_cache.check_invariants()
        assert e.kv_cache.num_used_blocks == 0
        timelines = [t.to_dict() for t in e.finished_timelines]
        runs[kind] = (outputs, timelines, [r.to_dict() for r in e.step_records], e.stats())
    assert runs["plain"] == runs["fast"]
    _, timelines, _, stats = runs["plain"]
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.evictions > 0
    split = any(len(t["chunks"]) > 1 and not t["preemptions"] for t in timelines)
    assert split == chunked  # a prompt prefilled in chunks
    assert type(LLMEngine(FakeExecutor(), EngineConfig(kv_cache="plain")).kv_cache).__name__ == (
        "PlainKVCache"
    )


def test_an_unknown_kv_cache_is_refused() -> None:
    with pytest.raises(ValueError, match='kv_cache must be "fast" or "plain"'):
        engine(kv_cache="quick")
