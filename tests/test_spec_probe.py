"""Speculation priced for a run that did not speculate: a probe of its own requests measures
how often the n-gram lookup drafts and how many drafts are accepted, and the simulator
drafts in that share of steps."""

from __future__ import annotations

import math

import pytest

from servelab.analyze.diagnosis.findings import Finding
from servelab.analyze.tuning.candidates import RunFacts, generate
from servelab.engine.engine_config import EngineConfig
from servelab.engine.spec.ngram import NgramProposer
from servelab.engine.spec.proposer import DraftRequest
from servelab.sim.loop.sampled_proposals import SampledProposals
from servelab.sim.loop.simulation import SimRequest, Simulation
from servelab.sim.sim_target import roofline_target
from servelab.vocab import RequestTags
from servelab.workflows.spec_probe import (
    PROBE_MAX_TOKENS,
    AcceptanceProbe,
    ProbeRequest,
    probe_acceptance,
    sample,
)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def test_sampled_proposals_pass_drafts_on_at_their_rate():
    batch = [DraftRequest(f"r{i}", [1, 2, 3, 1, 2], 3) for i in range(2000)]
    for rate in (0.0, 0.3, 1.0):
        gate = SampledProposals(NgramProposer(1, 3), rate, seed=0)
        drafted = sum(1 for d in gate.propose(batch).values() if d)
        assert abs(drafted / len(batch) - rate) < 0.04
    with pytest.raises(ValueError, match="share of steps"):
        SampledProposals(NgramProposer(1, 3), 1.5, seed=0)


def _spec_steps(rate: float) -> list[dict]:
    fixed = {**NGRAM, "adaptive": False}  # four drafts whenever the lookup drafts
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=512, speculative_config=fixed)
    target = roofline_target("h100", "llama-3.1-8b", engine_config=cfg)
    target.spec_proposal_rate = rate
    reqs = [
        SimRequest(f"r{i}", 0.0, [7] * 64, 200, tags=RequestTags(workload_class="c"))
        for i in range(4)
    ]
    return Simulation(target.factory, reqs).run().steps


def test_the_simulator_drafts_in_its_proposal_rate_of_steps():
    every, some, none = (_spec_steps(r) for r in (1.0, 0.25, 0.0))
    assert sum(s["spec_proposed"] for s in none) == 0
    p1, p25 = (sum(s["spec_proposed"] for s in x) for x in (every, some))
    decodes = sum(s["decode_seqs"] for s in some)
    assert 0 < p25 < p1
    # a quarter of the sequence-steps carry their four drafts
    assert 0.2 < p25 / 4 / decodes < 0.3


def test_the_acceptance_matches_the_accepted_drafts_per_drafted_step():
    probe = AcceptanceProbe(k=4, requests=5, output_tokens=1277, asked=564, drafted=88,
                            proposed=147, accepted=43, seconds=1.0)  # fmt: skip
    a = probe.acceptance
    assert math.isclose(sum(a**i for i in range(1, 5)), 43 / 88, rel_tol=1e-6)
    assert math.isclose(probe.proposal_rate, 88 / 564)
    assert "16% of the steps" in probe.describe() and "43 of its 147 drafts" in probe.describe()
    nothing = AcceptanceProbe(4, 1, 10, 10, 0, 0, 0, 0.1)
    assert nothing.acceptance == 0.0 and nothing.proposal_rate == 0.0


def test_the_sample_is_the_first_requests_with_their_own_sampling():
    reqs = [
        SimRequest(
            f"r{i}",
            float(10 - i),
            [i + 1] * 8,
            500,
            tags=RequestTags(workload_class="c", temperature=t),
        )
        for i, t in enumerate([None, 0.0, 0.7, None])
    ]
    picked = sample(reqs, output_tokens=2 * PROBE_MAX_TOKENS)
    # latest-numbered first (sent first), each cut to the probe's length, two fill the budget
    assert [p.prompt_token_ids[0] for p in picked] == [4, 3]
    assert [p.max_tokens for p in picked] == [PROBE_MAX_TOKENS] * 2
    assert [p.temperature for p in picked] == [1.0, 0.7]  # the server's default where none
    # a run sent with --temperature 0: the requests whose class named none were greedy
    greedy = sample(reqs, output_tokens=4 * PROBE_MAX_TOKENS, run_temperature=0.0)
    assert [p.temperature for p in greedy] == [0.0, 0.7, 0.0, 0.0]


def test_a_probe_counts_what_the_engine_drafted_and_accepted(tiny_llama_dir):
    # greedy on a prompt that repeats itself: the lookup finds matches
    reqs = [ProbeRequest([5, 6, 7, 8] * 12, 24, 0.0), ProbeRequest([9, 10, 11] * 10, 24, 1.0)]
    engine = EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512)
    probe = probe_acceptance(str(tiny_llama_dir), "none", engine, reqs)
    assert probe.requests == 2 and probe.output_tokens == 48
    assert 0 < probe.drafted <= probe.asked <= 48
    assert probe.drafted <= probe.proposed <= 4 * probe.drafted
    assert 0 <= probe.accepted <= probe.proposed
    again = probe_acceptance(str(tiny_llama_dir), "none", engine, reqs)
    assert (again.asked, again.drafted, again.proposed, again.accepted) == (
        probe.asked, probe.drafted, probe.proposed, probe.accepted
    )  # fmt: skip


def test_a_probed_acceptance_gives_speculation_candidates_but_no_off_switch():
    finding = Finding(id="decode_bound", title="", summary="", evidence={}, confidence=0.9,
                      exact=True, levers=["speculative_decoding"])  # fmt: skip
    facts = RunFacts(config={"max_num_seqs": 64}, prompt_tokens=[100], priorities={"c": 0},
                     peak_seqs=4, probed_acceptance=0.3)  # fmt: skip
    cands, skipped = generate([finding], facts, ("overall", "tpot_p50"))
    spec = [c.id for c in cands if c.knob == "speculation"]
    assert spec == ["ngram-2", "ngram-4", "ngram-8"]
    # the per-token objective also asks for fewer sequences; nothing else is tried
    assert {c.knob for c in cands} == {"speculation", "max_num_seqs"}
    assert not skipped


def test_tune_probes_a_greedy_run_greedily(monkeypatch):
    # a run sent with --temperature 0 (no class temperature) was greedy: probing it at the
    # server's default 1.0 measured 19% of drafts accepted on code edits the engine accepts
    # 81% of greedily (docs/design/spec_decode.md)
    from types import SimpleNamespace

    from servelab.analyze.tuning.decision import Objective
    from servelab.workflows import tuning_loop

    seen: list[list[ProbeRequest]] = []
    monkeypatch.setattr(tuning_loop, "probe_acceptance", lambda *a: seen.append(a[3]))
    monkeypatch.setattr(tuning_loop, "engine_config_of", lambda run: EngineConfig())
    reqs = [
        SimRequest(f"r{i}", float(i), [7] * 8, 64, tags=RequestTags(workload_class="c"))
        for i in range(3)
    ]
    for sampling, want in (({"temperature": 0.0}, 0.0), ({}, 1.0)):
        run = SimpleNamespace(
            simulated=False, steps=[SimpleNamespace(spec_proposed=0)], model="smollm2-135m",
            manifest={"target_kind": "servelab", "config": {"sampling": sampling},
                      "server": {"kind": "servelab"}},
        )  # fmt: skip
        tuning_loop._probe_speculation(
            run, [], SimpleNamespace(requests=reqs), Objective("tpot_mean")
        )
        assert {p.temperature for p in seen[-1]} == {want}
