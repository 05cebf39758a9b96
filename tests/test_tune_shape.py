"""Candidates from the run's shape: knobs tried whether or not a finding fired, in a budget."""

from __future__ import annotations

import dataclasses

import rundirs

from servelab.analyze.diagnosis.findings import Finding
from servelab.analyze.lever_catalogue import LEVERS
from servelab.analyze.tuning import candidates
from servelab.analyze.tuning.candidates import RunFacts, for_server, generate
from servelab.analyze.tuning.shape import run_shape, shape_knobs
from servelab.rundir import load_run

GOODPUT = ("overall", "goodput")
QUIET = RunFacts(
    config={"enable_chunked_prefill": True, "max_num_batched_tokens": 512, "max_num_seqs": 8},
    prompt_tokens=[100, 120],
    priorities={"chat": 0},
    peak_seqs=4,
)


def test_a_quiet_run_with_short_prompts_and_one_class_calls_for_nothing():
    assert shape_knobs(QUIET) == {}
    assert generate([], QUIET, GOODPUT) == ([], [])


def test_each_fact_of_the_shape_calls_for_its_knob_without_a_finding():
    facts = dataclasses.replace(
        QUIET,
        config={**QUIET.config, "enable_prefix_caching": False, "num_kv_blocks": 100},
        prompt_tokens=[100, 900],
        priorities={"chat": 0, "batch": 0},
        shared_prefix_requests=12,
        waited_at_cap=30,
        waited=40,
        preemptions=3,
    )
    assert set(shape_knobs(facts)) == {
        "chunking",
        "max_num_seqs",
        "prefix_caching",
        "kv_memory",
        "priorities",
        "replicas",
    }
    cands, skipped = generate([], facts, GOODPUT)
    by_knob: dict[str, list] = {}
    for c in cands:
        by_knob.setdefault(c.knob, []).append(c)
    assert {c.id for c in by_knob["priorities"]} == {"first-batch", "first-chat"}
    assert [c.id for c in by_knob["prefix_caching"]] == ["prefix-cache-on"]
    assert {c.lever for c in by_knob["kv_memory"]} == {"kv_memory"}
    assert {c.engine["max_num_seqs"] for c in by_knob["max_num_seqs"]} >= {16, 32}
    assert "chunk-off" in {c.id for c in by_knob["chunking"]}
    # no finding: the objective is their target, and each says which fact called for it
    c = by_knob["prefix_caching"][0]
    assert c.findings == () and c.target == GOODPUT
    assert (
        c.because == "the run's shape: 12 requests share a prompt prefix and prefix caching is off"
    )
    assert "one machine cannot verify" in by_knob["replicas"][0].because
    # each candidate carries the catalogue's complexity and what the operator takes on
    assert all(
        c.complexity == LEVERS[c.lever].complexity and c.operates == LEVERS[c.lever].operates
        for c in cands
    )
    assert by_knob["priorities"][0].complexity == "medium"
    # the chunking shape also calls for disaggregation, which this engine cannot predict
    assert {u.lever: u.reason for u in skipped} == {
        "disaggregation": LEVERS["disaggregation"].unpredicted
    }
    # another server: priorities are named as its own scheduling flags, not predicted
    _, why = for_server("vllm", cands, skipped)
    assert "--scheduling-policy priority" in {u.lever: u.reason for u in why}["priorities"]


def test_a_finding_and_the_shape_on_one_knob_keep_the_findings_target():
    facts = dataclasses.replace(QUIET, prompt_tokens=[100, 900])
    f = Finding(
        id="itl_prefill_interference", title="", summary="", evidence={}, confidence=0.9,
        exact=True, levers=["batch_budget_down"],
    )  # fmt: skip
    cands, _ = generate([f], facts, GOODPUT)
    down = next(c for c in cands if c.id == "chunk-256")
    up = next(c for c in cands if c.id == "chunk-1024")
    assert down.target == ("overall", "max_itl_mean") and down.because.startswith("the findings")
    assert up.target == GOODPUT and up.because.startswith("the run's shape")


def test_the_search_states_its_budget_and_names_what_it_skipped(monkeypatch):
    monkeypatch.setattr(candidates, "SEARCH_BUDGET", 5)
    facts = dataclasses.replace(
        QUIET,
        prompt_tokens=[100, 900],
        priorities={"a": 0, "b": 0, "c": 0},
        waited=10,
    )
    f = Finding(
        id="queue_bound", title="", summary="", evidence={}, confidence=0.9, exact=True,
        levers=["priorities"],
    )  # fmt: skip
    cands, skipped = generate([f], facts, GOODPUT)
    assert len(cands) == 5
    # the finding's knob is kept whole; the shape's fill the rest in grid order
    assert sum(c.knob == "priorities" for c in cands) == 3
    assert [c.id for c in cands if c.knob == "chunking"] == ["chunk-64", "chunk-128"]
    over = [u for u in skipped if "search budget of 5" in u.reason]
    assert {u.lever for u in over} == {"batch_budget_down", "batch_budget_up", "capacity"}
    named = " ".join(u.reason for u in over)
    assert "replicas-4" in named and "chunk-off" in named
    # what was kept and what was skipped add up to the whole grid
    monkeypatch.setattr(candidates, "SEARCH_BUDGET", 100)
    everything, _ = generate([f], facts, GOODPUT)
    assert len(everything) == 5 + named.count("-")


def test_the_shape_is_read_from_a_runs_records_and_steps(tmp_path):
    pre = load_run(rundirs.preemptions(tmp_path / "p"))
    assert run_shape(pre, 64)["preemptions"] > 0
    shared = load_run(rundirs.shared_prefix(tmp_path / "s"))
    assert run_shape(shared, 64)["shared_prefix_requests"] == 60
    burst = load_run(rundirs.burst(tmp_path / "b"))
    s = run_shape(burst, 8)
    assert s["waited"] > 0 and 0 < s["waited_at_cap"] <= s["waited"]
    assert run_shape(burst, None)["waited_at_cap"] == 0


def test_two_findings_on_two_knobs_are_also_tried_together():
    facts = dataclasses.replace(
        QUIET,
        config={**QUIET.config, "num_kv_blocks": 100, "kv_cache_memory_gb": 1.0},
        prompt_tokens=[100, 900],
    )
    found = [
        Finding(
            id=fid, title="", summary="", evidence={}, confidence=0.9, exact=True, levers=[lever]
        )
        for fid, lever in (
            ("itl_prefill_interference", "batch_budget_down"),
            ("kv_pressure", "kv_memory"),
        )
    ]
    cands, _ = generate(found, facts, GOODPUT)
    (pair,) = [c for c in cands if c.parts > 1]
    # the middle of each knob's values in its finding's direction: 128 of 64/128/256, 2x
    assert pair.id == "chunk-128+kv-x2" and pair.knob == "chunking+kv_memory"
    assert pair.engine["max_num_batched_tokens"] == 128 and pair.engine["num_kv_blocks"] == 200
    assert pair.findings == ("itl_prefill_interference", "kv_pressure")
    assert pair.because.startswith("two findings pull on this run")
    # one finding on two knobs is no pair
    one = [dataclasses.replace(found[1], levers=["kv_memory", "max_num_seqs_down"])]
    assert not any(c.parts > 1 for c in generate(one, facts, GOODPUT)[0])
    # a pair is not combined again, and another server keeps it only if it has both flags
    assert {c.id for c in for_server("vllm", cands, [])[0]} >= {pair.id}
    assert pair.id not in {c.id for c in for_server("llamacpp", cands, [])[0]}


def test_serving_a_class_first_targets_that_class_s_own_objective():
    facts = dataclasses.replace(QUIET, priorities={"chat": 0, "batch": 0})
    cands, _ = generate([], facts, ("chat", "ttft_mean"))
    target = {c.id: c.target for c in cands if c.knob == "priorities"}
    # the objective names chat's figure: serving chat first is judged on it; the other
    # class keeps its tail TTFT
    assert target == {"first-chat": ("chat", "ttft_mean"), "first-batch": ("batch", "ttft_p95")}


def test_a_run_without_steps_shows_its_cap_by_what_its_client_had_in_flight():
    from servelab.analyze.tuning.shape import arrived_at_cap
    from servelab.vocab import ClientRecord

    def rec(send: float, done: float) -> ClientRecord:
        return ClientRecord(
            request_id=f"r{send}", workload_class="chat", intended_send=send,
            actual_send=send, done=done,
        )  # fmt: skip

    # 0-10 and 1-10 in flight: the one sent at 2 finds two; at 11 both have ended
    records = [rec(0, 10), rec(1, 10), rec(2, 3), rec(11, 12)]
    assert arrived_at_cap(records, 2) == 1
    assert arrived_at_cap(records, 3) == 0
    facts = dataclasses.replace(QUIET, arrived_at_cap=7)
    assert shape_knobs(facts) == {
        "max_num_seqs": "7 requests were sent with the cap of 8 sequences already in flight"
    }
    cands, _ = generate([], facts, ("overall", "e2e_mean"))
    assert {c.engine["max_num_seqs"] for c in cands if c.knob == "max_num_seqs"} >= {16, 32}


def test_a_per_token_objective_calls_for_fewer_sequences_and_speculation_without_a_finding():
    probed = dataclasses.replace(QUIET, probed_acceptance=0.4)
    assert generate([], probed, ("overall", "ttft_mean")) == ([], [])  # not per token
    cands, _ = generate([], probed, ("overall", "tpot_mean"))
    by_knob: dict[str, list] = {}
    for c in cands:
        by_knob.setdefault(c.knob, []).append(c)
    assert set(by_knob) == {"max_num_seqs", "speculation"}
    downs = {
        c.engine["max_num_seqs"] for c in by_knob["max_num_seqs"] if c.lever == "max_num_seqs_down"
    }
    assert downs == {1, 2, 3}  # a quarter, half and three quarters of the 4 a step ran
    ks = {c.engine["speculative_config"]["num_speculative_tokens"] for c in by_knob["speculation"]}
    assert ks == {2, 4, 8}
    assert all(c.target == ("overall", "tpot_mean") and c.findings == () for c in cands)
    assert "per output token" in by_knob["speculation"][0].because
    # one sequence a step and no acceptance known: nothing to try
    alone = dataclasses.replace(QUIET, peak_seqs=1)
    assert generate([], alone, ("overall", "itl_p50")) == ([], [])
