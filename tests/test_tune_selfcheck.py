"""`servelab tune`'s self-check is out of sample: each held-out part of the run is replayed by
a model fitted to the rest, and a figure a decision rests on is never passed unchecked.

Inputs are simulated runs (`servelab sim ... --out DIR`), replayed in about a second.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from servelab.analyze.summary import measured_window
from servelab.analyze.tuning.prediction import FigureSet, Prediction, figures, self_check, wilson
from servelab.cli import app
from servelab.rundir import load_run
from servelab.sim.fit.asrun import folds, requests_as_run
from servelab.workflows.tuning_loop import TuneSpec, predict

runner = CliRunner()


def _sim(out: Path, workload: str, *load: str) -> Path:
    r = runner.invoke(
        app, ["sim", "--hardware", "cpu", "--workload", workload, *load, "--out", str(out)]
    )
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory) -> Path:
    """One class, light enough that a quarter of its requests meet their SLOs: each half of
    it pins down TTFT p50, goodput and attainment (10 or more values), not a p95."""
    out = tmp_path_factory.mktemp("selfcheck") / "chat"
    return _sim(out, "chat", "--rate", "0.3", "--duration", "200s", "--seed", "2")


def test_folds_alternate_time_windows_and_hold_out_every_request_once(chat_run):
    run = load_run(chat_run)
    parts = folds(run)
    assert len(parts) == 2
    held = [f.held_out for f in parts]
    assert not held[0] & held[1] and held[0] | held[1] == {r.request_id for r in run.records}
    a, b = parts
    t = a.start + a.width / 2  # the first window is part 1's, the second part 2's
    assert a.holds(t) and b.fits(t) and b.holds(t + a.width) and a.holds(t + 2 * a.width)


def test_the_run_without_a_planted_error_passes_out_of_sample(chat_run):
    t = predict(load_run(chat_run), TuneSpec(chat_run, seeds=2, jobs=1))
    assert t.refused is None, t.refused
    assert t.check is not None and t.check.ok and t.check.parts == 2
    verdicts = {(r.scope, r.name): r.verdict for r in t.check.rows}
    # goodput, attainment and each candidate's target are checked, not only latencies
    for name in ("goodput", "attainment", "ttft_p50"):
        assert verdicts[("overall", name)] == "ok", name
    for j in t.judged:
        assert verdicts[j.candidate.target] in ("ok", "too_small")
    assert verdicts[("overall", "ttft_p95")] == "too_small"  # under 100 requests a half
    assert "thin" not in verdicts.values()


def test_a_planted_cost_error_in_a_held_out_part_fails_the_check(chat_run, tmp_path):
    planted = tmp_path / "planted"
    shutil.copytree(chat_run, planted)
    second = folds(load_run(chat_run))[1]
    # The steps of the second part's windows took 25% longer than those of the first for
    # the same work: a model fitted to either half mis-prices the other.
    lines = []
    for line in (planted / "steps.jsonl").read_text().splitlines():
        s = json.loads(line)
        if second.holds(s["start"]):
            s["end"] = s["start"] + (s["end"] - s["start"]) * 1.25
        lines.append(json.dumps(s))
    (planted / "steps.jsonl").write_text("\n".join(lines) + "\n")
    t = predict(load_run(planted), TuneSpec(planted, seeds=2, jobs=1))
    assert t.refused is not None and "held-out parts" in t.refused, t.refused
    assert t.decision is None and t.judged == []
    assert t.check is not None and not t.check.ok
    strayed = {(r.scope, r.name): r for r in t.check.strayed}
    # the first part, replayed by the model fitted to the costlier second one, is too slow:
    # beyond the tolerance and outside the measured CI where the figure is tight (a decode
    # step's cost is what TPOT measures)
    row = strayed[("overall", "tpot_p50")]
    assert row.part == 0 and row.error is not None and row.error > 0.15
    assert row.in_ci is False
    assert "overall tpot_p50 (+" in t.refused and "outside the measured 95% CI" in t.refused
    # TTFT p50 is as far off, but within the wide CI of a median of ~60 dispersed TTFTs
    (ttft,) = [r for r in t.check.rows if (r.scope, r.name) == ("overall", "ttft_p50")]
    assert ttft.part == 0 and ttft.error is not None and ttft.error > 0.15


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """Mixed traffic for 40 s: 15 requests in a half, 3 of them RAG."""
    out = tmp_path_factory.mktemp("selfcheck") / "mixed"
    return _sim(out, "mixed", "--rate", "0.5", "--duration", "40s", "--seed", "3")


def test_a_class_too_small_for_the_objective_is_said_so_not_passed(small):
    # TTFT p50 needs 10 requests in each half: the run has 3 RAG requests in one
    run = load_run(small)
    t = predict(run, TuneSpec(small, objective="ttft_p50@rag", seeds=2, jobs=1))
    assert t.refused is not None, "a too-small objective was passed"
    assert t.refused.startswith("the run is too small for this decision: TTFT p50 rests on")
    assert "requests of class rag in a held-out part, needs 10" in t.refused
    assert t.decision is None and t.judged == []
    assert t.check is not None and not t.check.strayed
    (row,) = [r for r in t.check.rows if (r.scope, r.name) == ("rag", "ttft_p50")]
    assert row.verdict == "too_small" and row.n < row.needed == 10
    # --ignore-gates predicts anyway, and says what the decision rests on
    spec = TuneSpec(small, objective="ttft_p50@rag", seeds=2, jobs=1, ignore_gates=True)
    t = predict(run, spec)
    assert t.refused is None and t.decision is not None
    assert any("rag ttft_p50" in n and "predicted anyway" in n for n in t.notes), t.notes


def _figs(ttft: float, n: int, ci: tuple[float, float] | None = None) -> FigureSet:
    return FigureSet(
        {"overall": {"ttft_p50": ttft}},
        ci={"overall": {"ttft_p50": ci}} if ci else {},
        counts={"overall": {"ttft": n, "requests": n}},
    )


def test_every_part_is_checked_and_the_worst_one_is_shown():
    replay = Prediction("part", [{"overall": {"ttft_p50": 1.0}}] * 3)
    good, off = (_figs(1.0, 40), replay), (_figs(0.8, 40), replay)  # replay 25% slow
    check = self_check([good, off], 0.15, ["ttft_p50"])
    (row,) = check.rows
    assert row.verdict == "strayed" and row.part == 1 and row.error == pytest.approx(0.25)
    assert self_check([good, good], 0.15, ["ttft_p50"]).ok
    # a part with too few values is never passed, whatever the error
    (row,) = self_check([good, (_figs(1.0, 4), replay)], 0.15, ["ttft_p50"]).rows
    assert row.verdict == "too_small" and (row.n, row.needed) == (4, 10)


def test_candidates_whose_target_the_run_cannot_check_are_judged_on_the_objective(small):
    # TTFT p50 overall is pinned (15 requests a half); the priorities' targets, each class's
    # TTFT p95, need 100 a half: those candidates are judged on the objective alone, and a
    # note says why
    t = predict(load_run(small), TuneSpec(small, objective="ttft_p50", seeds=2, jobs=1))
    assert t.refused is None and t.decision is not None, t.refused
    prio = [j.candidate for j in t.judged if j.candidate.knob == "priorities"]
    assert prio and all(c.target == ("overall", "ttft_p50") for c in prio)
    assert any(
        n.startswith("the run is too small for this decision: TTFT p95 rests on")
        and n.endswith("judged on the objective alone")
        for n in t.notes
    ), t.notes
    targets = {j.candidate.target for j in t.judged}
    assert all(t.check.too_small(*target) is None for target in targets)


def test_an_error_within_the_measured_ci_is_unsettled_not_a_stray_nor_a_pass():
    replay = Prediction("part", [{"overall": {"ttft_p50": 1.3}}] * 3)  # 30% slow
    wide = (_figs(1.0, 40, (0.7, 1.4)), replay)
    narrow = (_figs(1.0, 40, (0.9, 1.1)), replay)
    noisy = self_check([wide], 0.15, ["ttft_p50"])
    (row,) = noisy.rows
    assert row.verdict == "unsettled" and row.in_ci is True and row.error == pytest.approx(0.3)
    assert not noisy.strayed and not noisy.ok  # neither blamed nor passed
    why = noisy.too_small("overall", "ttft_p50")
    assert why is not None and why.startswith("the run is too noisy for this decision")
    check = self_check([narrow], 0.15, ["ttft_p50"])
    (row,) = check.strayed
    assert row.in_ci is False and not check.ok
    assert row.off_by == "+30%, outside the measured 95% CI 0.9-1.1 s, held-out part 1"
    assert row.to_dict()["measured_ci"] == (0.9, 1.1) and row.to_dict()["in_ci"] is False
    # within the tolerance, a figure is ok whatever its CI says
    close = Prediction("part", [{"overall": {"ttft_p50": 1.14}}] * 3)
    assert self_check([(narrow[0], close)], 0.15, ["ttft_p50"]).ok


def test_wilson_interval_of_a_share():
    # by hand, z = 1.96: centre (0.5 + z^2/60) / (1 + z^2/30) = 0.5, half-width
    # z / (1 + z^2/30) * sqrt(0.25/30 + z^2/3600) = 0.16846
    lo, hi = wilson(15, 30)
    assert lo == pytest.approx(0.33154, abs=1e-4) and hi == pytest.approx(0.66846, abs=1e-4)
    # 0 of 20: not a zero-wide interval, and never below 0
    lo, hi = wilson(0, 20)
    assert lo == 0.0 and hi == pytest.approx(0.16113, abs=1e-4)


def test_attainment_and_goodput_carry_their_share_intervals(chat_run):
    run = load_run(chat_run)
    fs = figures(run.records, requests_as_run(run).slos, n_boot=50)
    vals, cis = fs.values["overall"], fs.ci["overall"]
    met, sent = fs.counts["overall"]["met"], fs.counts["overall"]["requests"]
    assert cis["attainment"] == pytest.approx(wilson(met, sent))
    lo, hi = cis["goodput"]
    assert vals["goodput"] is not None and lo < vals["goodput"] < hi
    # goodput is completions/s times the share of them that met the SLOs
    share = vals["goodput"] / vals["requests_s"]
    done = round(vals["requests_s"] * measured_window(run.records).duration)
    w_lo, w_hi = wilson(round(share * done), done)
    assert (lo, hi) == pytest.approx((vals["requests_s"] * w_lo, vals["requests_s"] * w_hi))
    assert "output_tok_s" not in cis  # a rate over every token carries none
    assert not figures(run.records, requests_as_run(run).slos).ci["overall"]
