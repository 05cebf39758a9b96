"""`servelab tune --verify`: the arms (as run and the top three), fresh requests per repeat,
the paired tests blocked by repeat, the uplift threshold and the MAPE of the predictions."""

from __future__ import annotations

import io
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from servelab.analyze.diagnosis.findings import Finding
from servelab.analyze.tuning.candidates import Candidate, RunFacts, generate
from servelab.analyze.tuning.decision import Decision, Objective, judge
from servelab.analyze.tuning.prediction import Prediction
from servelab.analyze.tuning.verification import (
    AS_RUN,
    SIGN_FLIP,
    STRATIFIED,
    TUNED,
    Arm,
    sign_flip_p,
    verify,
)
from servelab.cli import app
from servelab.report.tuning_view import render_tuning
from servelab.rundir import load_run
from servelab.vocab import ClientRecord
from servelab.workflows.tuning_loop import VERIFY_SEED_OFFSET, TuneSpec, predict, verify_choice

runner = CliRunner()
OBJ = ("overall", "e2e_p95")


def _records(tag: str, scale: float, n: int = 24) -> list[ClientRecord]:
    """``n`` requests sent 0.5 s apart, each taking ``scale`` x its own base time."""
    out = []
    for i in range(n):
        t, f = i * 0.5, scale * (1 + ((i * 7) % 10) / 20)
        out.append(
            ClientRecord(
                request_id=f"{tag}-r{i:06d}",
                workload_class="chat",
                intended_send=t,
                actual_send=t,
                input_tokens=100,
                output_tokens=4,
                first_byte=t + 0.1 * f,
                chunk_times=[t + (0.1 + 0.05 * k) * f for k in range(4)],
                chunk_tokens=[1] * 4,
                done=t + 0.3 * f,
                status=200,
            )
        )
    return out


def _pred(e2e: float) -> Prediction:
    return Prediction("p", [{"overall": {"e2e_p95": e2e}} for _ in range(3)], [1.0] * 3)


def _arms(*predicted: float) -> list[Arm]:
    names = [AS_RUN, TUNED, "top-2", "top-3"]
    return [Arm(names[k], f"setting {k}", _pred(e), OBJ) for k, e in enumerate(predicted)]


def _runs(scales: dict[str, list[float]]) -> dict[str, list[Any]]:
    """Per arm, one stand-in run per repeat (``verify`` reads its records)."""
    return {
        name: [SimpleNamespace(records=_records(f"{name}{r}", s)) for r, s in enumerate(per)]
        for name, per in scales.items()
    }


def test_the_paired_test_finds_planted_gains_and_the_mape_is_of_the_changes():
    # Repeat 1 ran on a machine twice as slow: only the paired, blocked change is 30%.
    runs = _runs({AS_RUN: [1.0, 2.0], TUNED: [0.7, 1.4], "top-2": [1.0, 2.0]})
    v = verify(_arms(1.0, 0.75, 0.9), runs, OBJ, {}, n_perm=100)  # type: ignore[arg-type]
    tuned, second = v.arms
    assert tuned.objective.test == STRATIFIED and v.repeats == 2
    assert tuned.objective.per_repeat == pytest.approx([-0.3, -0.3])
    assert tuned.objective.measured == pytest.approx(-0.3)
    assert tuned.objective.predicted == pytest.approx(-0.25)
    assert tuned.objective.p_value is not None and tuned.objective.p_value < 0.05
    assert second.objective.measured == pytest.approx(0.0)
    assert second.objective.p_value is not None and second.objective.p_value > 0.5
    assert v.answer == "apply" and v.verdict == "better"
    assert v.best == TUNED and v.top1_best
    # |predicted - measured| / |1 + measured| per arm: 0.05 / 0.7 and 0.1 / 1
    assert v.mape == pytest.approx((0.05 / 0.7 + 0.1) / 2)
    assert v.mape_ok
    doc = v.to_dict()
    assert doc["top1_measured_best"] is True and doc["arms"][0]["objective"]["p_value"] < 0.05


def test_changes_are_judged_against_the_prediction_on_the_requests_measured():
    # The run's prediction says -25%; on each repeat's own (heavier) requests the model says
    # -40% and -20%: the error is of their mean, -30%, which the measurement matches.
    runs = _runs({AS_RUN: [1.0, 2.0], TUNED: [0.7, 1.4]})
    fresh = [{AS_RUN: _pred(2.0), TUNED: _pred(1.2)}, {AS_RUN: _pred(1.0), TUNED: _pred(0.8)}]
    v = verify(_arms(1.0, 0.75), runs, OBJ, {}, n_perm=100, fresh=fresh)  # type: ignore[arg-type]
    tuned = v.arms[0].objective
    assert tuned.predicted == pytest.approx(-0.3) and tuned.on_run == pytest.approx(-0.25)
    assert tuned.error == pytest.approx(0.0) and v.mape == pytest.approx(0.0)
    assert "predicted -30.0% on these requests, -25.0% on the run's" in v.sentence
    # the level rows carry the fresh prediction too: the mean of the repeats' medians
    row = next(r for r in v.rows if r.config == AS_RUN and r.name == "e2e_p95")
    assert row.predicted is not None and row.predicted.median == pytest.approx(1.5)
    assert (row.predicted.lo, row.predicted.hi, row.predicted.n) == (1.0, 2.0, 6)
    # without them, the run's prediction is the one judged
    plain = verify(_arms(1.0, 0.75), runs, OBJ, {}, n_perm=100)  # type: ignore[arg-type]
    assert plain.arms[0].objective.predicted == pytest.approx(-0.25)


def test_below_the_uplift_or_not_significant_the_answer_is_keep():
    runs = _runs({AS_RUN: [1.0, 1.5], TUNED: [0.97, 1.455]})  # 3% faster in both repeats
    v = verify(_arms(1.0, 0.8), runs, OBJ, {}, n_perm=100)  # type: ignore[arg-type]
    assert v.arms[0].objective.p_value is not None and v.arms[0].objective.p_value < 0.05
    assert v.answer == "keep" and "below the 5% uplift" in v.sentence
    lower = verify(_arms(1.0, 0.8), runs, OBJ, {}, min_uplift=0.02, n_perm=100)  # type: ignore[arg-type]
    assert lower.answer == "apply"
    # where another arm gains and the top-1 does not, the top-1 was not measured best
    runs = _runs({AS_RUN: [1.0, 1.5], TUNED: [1.0, 1.5], "top-2": [0.8, 1.2]})
    v = verify(_arms(1.0, 0.8, 0.9), runs, OBJ, {}, n_perm=100)  # type: ignore[arg-type]
    assert v.answer == "keep" and v.best == "top-2" and not v.top1_best
    assert "Measured best: setting 2 (top-2)" in v.sentence


def test_enough_repeats_take_the_sign_flip_test_over_repeats():
    assert sign_flip_p([0.1] * 6) == pytest.approx(2 / 64)
    assert sign_flip_p([0.1, -0.1]) == 1.0
    runs = _runs(
        {AS_RUN: [1.0 + r / 10 for r in range(6)], TUNED: [0.8 + r / 10 for r in range(6)]}
    )
    v = verify(_arms(1.0, 0.8), runs, OBJ, {})  # type: ignore[arg-type]
    assert v.arms[0].objective.test == SIGN_FLIP and v.repeats == 6
    assert v.arms[0].objective.p_value == pytest.approx(2 / 64) and v.answer == "apply"


@dataclass
class StandIn:
    url: str
    engine_args: str
    command: list[str]


def test_verify_measures_as_run_and_the_top_three_on_fresh_paired_requests(tmp_path, monkeypatch):
    """The matrix runner below the workflow is replaced by one that records each bench's
    seed and copies a run: four arms, a new seed per repeat, one seed across the arms of a
    repeat, the arms' order rotating."""
    from servelab.workflows import matrix

    run_dir = tmp_path / "run"
    r = runner.invoke(
        app,
        [
            "sim", "--hardware", "cpu", "--workload", "rag", "--concurrency", "2",
            "--requests", "6", "--length-scale", "0.3", "--seed", "7", "--out", str(run_dir),
        ],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    run = load_run(run_dir)
    spec = TuneSpec(run_dir, seeds=2, jobs=1, verify=True, repeats=2, out=tmp_path / "v")
    t = predict(run, spec)
    assert t.baseline is not None, t.refused
    obj = Objective.parse(None, has_slos=True)
    chunks = _chunk_candidates()[:3]
    assert len(chunks) == 3
    judged = [judge(t.baseline, c, t.baseline, obj) for c in chunks]
    t.decision = Decision(obj, judged[0], judged, [], [])
    ran: list[tuple[str, int]] = []

    def bench(opts, console, on_run):
        ran.append((opts.out.name, opts.seed))
        shutil.copytree(run_dir, opts.out)
        return 0

    monkeypatch.setattr(matrix, "bench_logged", bench)
    servers = {n: StandIn("http://x", "", ["x"]) for n in (AS_RUN, TUNED, "top-2", "top-3")}
    console = Console(record=True, width=100)
    v = verify_choice(run, t, spec, console, servers)
    names = [n.rpartition("-r")[0] for n, _ in ran]
    assert names == [AS_RUN, TUNED, "top-2", "top-3", TUNED, "top-2", "top-3", AS_RUN]
    seed = 7  # the run's: each repeat plans with a seed of its own
    fresh = [seed + VERIFY_SEED_OFFSET, seed + VERIFY_SEED_OFFSET + 1]
    assert {s for n, s in ran if n.endswith("-r0")} == {fresh[0]}
    assert {s for n, s in ran if n.endswith("-r1")} == {fresh[1]}
    assert v.plan_seeds == fresh and [a.name for a in v.arms] == [TUNED, "top-2", "top-3"]
    assert [a.title for a in v.arms] == [c.title for c in chunks]
    # the same requests in every arm: no change measured, and so nothing to apply
    assert all(a.objective.measured == pytest.approx(0.0) for a in v.arms)
    assert v.answer == "keep"
    t.verification = v
    out = Console(record=True, width=100, file=io.StringIO())
    render_tuning(t, out)
    said = out.export_text()
    assert "measured best on the objective" in said and "top-3" in said
    assert max(len(line) for line in said.splitlines()) <= 100


def _chunk_candidates() -> list[Candidate]:
    """Three values of the chunk budget, as a finding of prefill interference proposes."""
    finding = Finding(
        id="itl_prefill_interference", title="t", summary="", evidence={}, confidence=0.9,
        exact=True, levers=["batch_budget_down"],
    )  # fmt: skip
    cands, _ = generate(
        [finding],
        RunFacts(
            config={"max_num_batched_tokens": 2048}, prompt_tokens=[400], priorities={}, peak_seqs=2
        ),
        ("overall", "goodput"),
    )
    return [c for c in cands if c.knob == cands[0].knob]


def test_verify_needs_two_repeats_and_a_sensible_uplift(tmp_path: Path):
    r = runner.invoke(app, ["tune", str(tmp_path), "--repeats", "1"])
    assert r.exit_code == 2 and "--repeats must be >= 2" in " ".join(r.output.split())
    r = runner.invoke(app, ["tune", str(tmp_path), "--min-uplift", "5"])
    assert r.exit_code == 2 and "--min-uplift" in r.output
