"""analyze.tuning.gates: `servelab tune` refuses, with reasons and counts, a run marked
invalid, one with too many failed requests, one too small to decide its objective and one
that started on an unflushed prefix cache; the failed requests of a run it accepts replay
as failures.

Each planted run is a copy of one simulated run (80 chat requests) with one thing changed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from servelab.analyze.tuning.gates import gates, needed_per_class
from servelab.analyze.tuning.verification import AS_RUN
from servelab.cli import app
from servelab.rundir import load_run
from servelab.sim.fit.asrun import replay_target, requests_as_run
from servelab.workflows.tuning_loop import _Simulator

runner = CliRunner()


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gates") / "clean"
    r = runner.invoke(
        app,
        ["sim", "--hardware", "cpu", "--workload", "chat", "--concurrency", "4",
         "--requests", "40", "--length-scale", "0.2", "--seed", "2", "--out", str(out)],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


def _planted(src: Path, dst: Path, errors: int = 0, **manifest: object) -> Path:
    shutil.copytree(src, dst)
    man = json.loads((dst / "manifest.json").read_text())
    man.update(manifest)
    (dst / "manifest.json").write_text(json.dumps(man))
    lines = (dst / "requests.jsonl").read_text().splitlines()
    for i in range(errors):  # the last requests of sessions fail: none is sent after them
        rec = json.loads(lines[-1 - i])
        rec["error"] = "HTTP 503: overloaded"
        lines[-1 - i] = json.dumps(rec)
    (dst / "requests.jsonl").write_text("\n".join(lines) + "\n")
    return dst


def test_a_clean_run_large_enough_for_its_objective_passes(clean):
    run = load_run(clean)
    assert len(run.records) >= needed_per_class("goodput") == 30
    assert gates(run, "overall", "goodput") == []


@pytest.mark.parametrize(
    ("name", "plant", "said"),
    [
        ("invalid", {"valid": False, "invalid_reason": "client lag 9 ms"}, "client lag 9 ms"),
        ("errors", {"errors": 8}, "8 of its 80 requests failed (10%"),
        (
            "warm_cache",
            {
                "stages": [
                    {"label": None, "prefix_cache": "the server does not allow it (HTTP 404)"}
                ]
            },
            "not flushed before it ran (the server does not allow it (HTTP 404))",
        ),
    ],
)
def test_each_gate_refuses_its_planted_run(clean, tmp_path, name, plant, said):
    run = load_run(_planted(clean, tmp_path / name, **plant))  # type: ignore[arg-type]
    (gate,) = gates(run, "overall", "goodput")
    assert gate.name == name and gate.refused and said in gate.reason


def test_a_run_too_small_for_its_objective_says_how_many_it_needs(clean):
    run = load_run(clean)
    assert needed_per_class("e2e_p95") == 100 and needed_per_class("itl_p99") == 500
    (gate,) = gates(run, "overall", "e2e_p95")
    assert gate.refused and gate.counts == {"needed_per_class": 100, "per_class": {"chat": 80}}
    assert "chat 80; it needs at least 100 per class" in gate.reason
    (gate,) = gates(run, "chat", "ttft_p99")
    assert gate.counts["needed_per_class"] == 500


def test_tune_refuses_with_the_reasons_and_tunes_with_ignore_gates(clean, tmp_path):
    bad = _planted(clean, tmp_path / "bad", errors=8, valid=False, invalid_reason="lag")
    r = runner.invoke(app, ["tune", str(bad), "--json", "--seeds", "2", "--jobs", "1"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert "not a run to tune from" in doc["refused"]
    assert "marked invalid: lag" in doc["refused"] and "8 of its 80" in doc["refused"]
    assert doc["self_check"] is None and doc["gated"]  # refused before the replay
    # the terminal leads with the refusal: a run never diagnosed has no "no findings" line
    r = runner.invoke(app, ["tune", str(bad), "--seeds", "2", "--jobs", "1"])
    flat = " ".join(r.output.split())
    assert "no prediction" in flat and "no findings" not in flat
    args = ["tune", str(bad), "--json", "--seeds", "2", "--jobs", "1", "--ignore-gates"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["refused"] is None or "not a run to tune from" not in doc["refused"]
    assert any(n.startswith("gate invalid:") for n in doc["notes"])


def test_failed_requests_replay_as_failures(clean, tmp_path):
    one = load_run(_planted(clean, tmp_path / "one", errors=1))
    (gate,) = gates(one, "overall", "goodput")
    assert gate.name == "errors" and not gate.refused  # 1 of 80: flagged, not refused
    replica = replay_target(one)
    asrun = requests_as_run(one, replica=replica)
    (failed,) = asrun.failed.values()
    assert failed == "HTTP 503: overloaded"
    sim = _Simulator(replica, asrun, 1, 1)
    try:
        (as_failed,) = sim.predict([(AS_RUN, None)])
        asrun.failed.clear()
        (as_served,) = sim.predict([(AS_RUN, None)])
    finally:
        sim.close()
    ok_failed = as_failed.seeds[0]["overall"]["attainment"]
    ok_served = as_served.seeds[0]["overall"]["attainment"]
    assert ok_failed == pytest.approx(ok_served - 1 / 80)
