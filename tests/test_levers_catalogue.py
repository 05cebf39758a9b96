"""The one catalogue of levers: diagnosis recommendations and tune candidates read it."""

from __future__ import annotations

import rundirs

from servelab.analyze.diagnosis.diagnose import diagnose
from servelab.analyze.diagnosis.findings import Finding
from servelab.analyze.lever_catalogue import COMPLEXITY, KNOBS, LEVERS, advice_flag
from servelab.analyze.levers import BUILDERS
from servelab.analyze.tuning.candidates import RunFacts, for_server, generate
from servelab.rundir import load_run


def _finding(fid: str, levers: list[str]) -> Finding:
    return Finding(
        id=fid, title=fid, summary="", evidence={}, confidence=0.9, exact=True, levers=levers
    )


def test_every_lever_is_catalogued_once_with_a_knob_a_cost_and_a_complexity():
    assert set(BUILDERS) == set(LEVERS)
    for lv in LEVERS.values():
        assert lv.knob is None or lv.knob in KNOBS, lv.name
        assert lv.complexity in COMPLEXITY and lv.cost and lv.operates and lv.findings
        # a lever with no knob has nothing to simulate and says why
        assert (lv.knob is None) == bool(lv.unpredicted), lv.name
    assert {lv.knob for lv in LEVERS.values()} - {None} == set(KNOBS)


def test_the_findings_that_fire_name_only_catalogued_levers_that_list_them(tmp_path):
    seen = set()
    for name in ("burst", "prefill_bound", "unchunked_stalls", "preemptions", "lagging_client"):
        d = diagnose(load_run(getattr(rundirs, name)(tmp_path / name)))
        for f in d.findings:
            for lever in f.levers:
                assert f.id in LEVERS[lever].findings, (f.id, lever)
                seen.add(lever)
        # each recommendation's complexity is its lever's, from the catalogue
        for r in d.recommendations:
            assert r.complexity == LEVERS[r.lever].complexity
            assert r.title in (LEVERS[r.lever].title, "Make prefixes reusable")
    assert len(seen) >= 5


def test_candidates_and_their_unpredicted_reasons_come_from_the_catalogue():
    facts = RunFacts(
        config={"enable_chunked_prefill": True, "max_num_batched_tokens": 512},
        prompt_tokens=[300, 900],
        priorities={"chat": 0, "batch": 1},
        peak_seqs=8,
    )
    findings = [
        _finding("itl_prefill_interference", ["batch_budget_down", "disaggregation"]),
        _finding("queue_bound", ["priorities"]),
    ]
    cands, skipped = generate(findings, facts, ("overall", "goodput"))
    assert {c.knob for c in cands} == {LEVERS["batch_budget_down"].knob, "priorities"}
    assert [u.reason for u in skipped] == [LEVERS["disaggregation"].unpredicted]
    _, elsewhere = for_server("vllm", cands, skipped)
    reasons = {u.lever: u.reason for u in elsewhere}
    assert reasons["disaggregation"] == LEVERS["disaggregation"].elsewhere
    assert reasons["priorities"] == LEVERS["priorities"].elsewhere


def test_each_server_spells_a_setting_its_own_way():
    assert advice_flag("servelab", "max_num_seqs", 8) == "--max-num-seqs 8"
    assert advice_flag("vllm", "enable_prefix_caching", False) == "--no-enable-prefix-caching"
    assert advice_flag("sglang", "max_num_seqs", 8) == "--max-running-requests 8"
    assert advice_flag("llamacpp", "max_num_batched_tokens", 256) == "--batch-size 256"
    assert advice_flag("llamacpp", "enable_chunked_prefill", False) is None
    assert advice_flag("other", "max_num_seqs", 8) is None
