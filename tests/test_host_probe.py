"""The host's speed beside each launch of the live twin checks (benchmarks/sim/host_probe.py,
twin_check's host-adjusted score): the probe, the factors, the scaled twin simulated again,
and a held-out case scored from another predictions directory. No server runs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import rundirs
from test_twin_protocol import _layout, _write_pred

from benchmarks.sim import host_probe
from benchmarks.sim import twin_check as tc
from servelab.rundir import load_run
from servelab.sim.fit.twin import calibrate_runs

GOLDEN = Path(__file__).parent / "data" / "twin" / "calm-vllm-twin.json"


def test_the_probe_times_both_parts_on_the_cpu_it_is_given():
    got = host_probe.measure(0)
    assert set(got) == set(host_probe.PARTS)
    assert all(0 < v < 10_000 for v in got.values())


def test_a_launchs_factor_is_its_probe_over_the_fitted_launches_geometric_mean():
    probes = {
        "plan": {"matmul_ms": 2.0, "gemv_ms": 2.0},
        "train": {"matmul_ms": 8.0, "gemv_ms": 2.0},  # speed 4: the fitted mean is sqrt(2*4)
        "held": {"matmul_ms": 4.0, "gemv_ms": 4.0},
    }
    fac = host_probe.factors(probes, ["plan", "train"])
    assert fac is not None
    assert fac["held"] == pytest.approx(4 / math.sqrt(8))
    assert fac["plan"] * fac["train"] == pytest.approx(1.0)
    # launches not probed are left out; nothing fitted probed: no factors at all
    assert host_probe.factors(probes, ["plan", "missing"])["held"] == pytest.approx(2.0)
    assert host_probe.factors(probes, ["missing"]) is None


def test_a_scaled_twin_multiplies_every_step_price_and_nothing_else():
    twin = json.loads(GOLDEN.read_text())
    scaled = host_probe.scaled_twin(twin, 1.25)
    assert twin == json.loads(GOLDEN.read_text())  # the original is untouched
    assert scaled["cost"] == {k: v * 1.25 for k, v in twin["cost"].items()}
    assert len(scaled["bootstrap"]) == len(twin["bootstrap"])
    for got, was in zip(scaled["bootstrap"], twin["bootstrap"], strict=True):
        assert got == {k: v * 1.25 for k, v in was.items()}
    rest = {k for k in twin if k not in ("cost", "bootstrap")}
    assert {k: scaled[k] for k in rest} == {k: twin[k] for k in rest}


def test_the_scaled_twin_simulated_again_decodes_that_much_slower(tmp_path):
    run = rundirs.as_other_target(rundirs.calm(tmp_path / "calm"), figures=True)
    twin = calibrate_runs([load_run(run)], "vllm serve m", "cpu").save(tmp_path / "twin.json")
    scaled = host_probe.write_scaled_twin(twin, 1.25, tmp_path / "scaled.json")
    paths = {1.0: twin, 1.25: scaled}
    tpot = {}
    for factor, twin in paths.items():
        out = tmp_path / f"sim-{factor}"
        res = subprocess.run(
            [sys.executable, "-m", "servelab.cli", "sim", "--calibration", str(twin),
             "--workload", "chat", "--concurrency", "2", "--requests", "6", "--length-scale",
             "0.3", "--seed", "3", "--seeds", "2", "--out", str(out)],
            capture_output=True, text=True,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        pred = json.loads((out / "prediction.json").read_text())
        tpot[factor] = pred["figures"]["tpot_p50"]["median"]
    assert tpot[1.25] / tpot[1.0] == pytest.approx(1.25, rel=0.03)


def test_a_held_out_case_is_scored_from_the_host_adjusted_predictions(tmp_path):
    train, held = _layout(tmp_path)
    root = tmp_path / tc.HOST
    root.mkdir()
    # only A was predicted again (0.4: on the mark); B has no adjusted prediction
    _write_pred(root / "sim-A", {"ttft_p50": 0.4, "output_tok_s": 20}, {"80": 0.1, "95": 0.3})
    results = tc.evaluate(tmp_path, train, held, True, preds=root)
    assert [r["case"] for r in results][-1] == "A"
    s = tc.score(results)
    assert s["ttft_p50"]["cases"] == 1 and s["ttft_p50"]["twin_mape"] == pytest.approx(0.0)
    # the change is still taken against the plain twin's prediction of the training run
    a = next(r for r in results[-1]["rows"] if r["figure"] == "ttft_p50")
    assert a["predicted_change"] == pytest.approx(0.4 / 0.25 - 1)
    summary = tc.summarize(tmp_path, results, held, preds=root)
    assert summary["intervals"]["80"]["figures"] == 2  # A's two figures, not B's


def test_the_host_factor_is_compared_with_the_step_speed_in_logs():
    assert tc.log_correlation([(1.0, 1.0), (1.1, 1.1), (0.9, 0.9)]) == pytest.approx(1.0)
    assert tc.log_correlation([(1.0, 1.0), (1.1, 1 / 1.1), (0.9, 1 / 0.9)]) == pytest.approx(-1.0)
    assert tc.log_correlation([(1.0, 1.0), (1.1, 1.1)]) is None  # too few
    assert tc.log_correlation([(1.0, 1.0), (1.0, 1.1), (1.0, 0.9)]) is None  # no spread


def test_a_rerun_keeps_the_probes_its_launches_recorded(tmp_path):
    assert tc.earlier_probes(tmp_path) == {}
    probes = {"plan": {"matmul_ms": 3.0, "gemv_ms": 2.5}}
    (tmp_path / "results.json").write_text(json.dumps({"host": {"probes": probes}}))
    assert tc.earlier_probes(tmp_path) == probes
    (tmp_path / "results.json").write_text(json.dumps({"score": {}}))  # written before probes
    assert tc.earlier_probes(tmp_path) == {}
