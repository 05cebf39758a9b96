"""The decision is a function of the candidate set: ties, what it takes to operate, the why."""

from __future__ import annotations

import itertools
from dataclasses import replace

from servelab.analyze.tuning.candidates import Candidate
from servelab.analyze.tuning.decision import Objective, combine, decide, judge
from servelab.analyze.tuning.prediction import Prediction

OBJ = Objective.parse(None, has_slos=True)
BASE = Prediction(
    "as-run", [{"overall": {"goodput": 1.0, "max_itl_mean": 2.0, "ttft_p95": 4.0}}] * 4
)


def _judged(cand: Candidate, goodput: float, itl: float = 2.0, ttft: float = 4.0):
    pred = Prediction(
        cand.id, [{"overall": {"goodput": goodput, "max_itl_mean": itl, "ttft_p95": ttft}}] * 4
    )
    return judge(BASE, cand, pred, OBJ)


def _chunk(b: int) -> Candidate:
    return Candidate(
        id=f"chunk-{b}",
        knob="chunking",
        lever="batch_budget_down",
        title=f"lower the chunk budget to {b}",
        engine={"enable_chunked_prefill": True, "max_num_batched_tokens": b},
        target=("overall", "max_itl_mean"),
        operates="one launch flag",
    )


def _outcome(d):
    return (
        d.chosen.candidate.id if d.chosen else None,
        tuple(j.candidate.id for j in d.ranked),
        tuple((r.candidate.id, r.reason) for r in d.rejected),
        d.why,
    )


def test_a_tie_is_decided_the_same_way_in_every_candidate_order():
    # The case: +30.0/+30.8/+31.6%. 64 ties with 128 and 128 with 256, but only
    # 128 and 256 are within a point of the best, and 128 cuts the gap more.
    js = [
        _judged(_chunk(64), 1.300, itl=0.5),
        _judged(_chunk(128), 1.308, itl=0.8),
        _judged(_chunk(256), 1.316, itl=1.2),
    ]
    outcomes = {_outcome(decide(list(p), OBJ)) for p in itertools.permutations(js)}
    assert len(outcomes) == 1
    chosen, ranked, rejected, why = outcomes.pop()
    assert chosen == "chunk-128" and ranked == ("chunk-128",)
    reasons = dict(rejected)
    assert reasons["chunk-256"].startswith("ties on the objective with lower the chunk budget")
    assert "improves its target more" in reasons["chunk-256"]
    assert reasons["chunk-64"].startswith("another value of the same knob is predicted better")
    assert why == "the best predicted goodput req/s (higher is better): +30.8%"


def test_a_smaller_gain_with_less_to_operate_wins_a_tie_and_says_so():
    prio = Candidate(
        id="first-chat",
        knob="priorities",
        lever="priorities",
        title="serve chat first",
        priorities={"chat": 0, "rag": 1},
        target=("overall", "ttft_p95"),
        complexity="medium",
        operates="a scheduling flag and a priority on every request",
    )
    js = [
        _judged(_chunk(128), 1.300, itl=1.0),
        _judged(prio, 1.305, ttft=3.0),
        _judged(_chunk(512), 1.10, itl=1.5),
    ]
    for p in itertools.permutations(js):
        d = decide(list(p), OBJ)
        assert d.chosen is not None and d.chosen.candidate.id == "chunk-128"
        assert [j.candidate.id for j in d.ranked] == ["chunk-128", "first-chat"]
        assert "a smaller gain with less to operate wins" in d.why
    # Out of the tie, the larger gain wins whatever it takes to operate.
    d = decide([_judged(_chunk(128), 1.30, itl=1.0), _judged(prio, 1.40, ttft=3.0)], OBJ)
    assert d.chosen is not None and d.chosen.candidate.id == "first-chat"


def test_a_combination_must_beat_the_best_single_setting_by_more_than_a_tie():
    seqs = Candidate(
        id="seqs-16",
        knob="max_num_seqs",
        lever="max_num_seqs_up",
        title="raise max_num_seqs to 16",
        engine={"max_num_seqs": 16},
        target=("overall", "ttft_p95"),
    )
    a, b = _judged(_chunk(128), 1.30, itl=1.0), _judged(seqs, 1.20, ttft=3.0)
    combo = combine([a, b])
    assert combo is not None and combo.parts == 2 and combo.complexity == "low"
    close = _judged(combo, 1.305, itl=1.0, ttft=3.0)
    d = decide([a, b], OBJ, combined=close)
    assert d.chosen is a
    (why,) = [r.reason for r in d.rejected if r.candidate.id == combo.id]
    assert "less to operate" in why
    far = _judged(replace(combo), 1.40, itl=1.0, ttft=3.0)
    d = decide([b, a], OBJ, combined=far)
    assert d.chosen is far and d.why.startswith("the best knobs together")


def test_a_pair_of_knobs_loses_a_tie_to_a_single_setting_and_is_not_combined_again():
    kv = Candidate(
        id="kv-x2",
        knob="kv_memory",
        lever="kv_memory",
        title="a 2x KV pool",
        engine={"num_kv_blocks": 200},
        target=("overall", "e2e_p95"),
    )
    both = combine([_judged(_chunk(128), 1.3), _judged(kv, 1.2)])
    assert both is not None
    pair = replace(both, knob="chunking+kv_memory")
    js = [_judged(_chunk(128), 1.300, itl=1.0), _judged(pair, 1.309, itl=1.0)]
    for p in itertools.permutations(js):
        d = decide(list(p), OBJ)
        assert d.chosen is not None and d.chosen.candidate.id == "chunk-128"
        assert "a smaller gain with less to operate wins" in d.why
    assert combine(d.ranked) is None  # the pair is not merged with its own parts
