"""bench.matrix: interleaved repeats across configs, over real HTTP to stand-in servers.

The stand-in for `servelab serve` (rundirs.StandIn) is the bench's deterministic test
server; "--slow" in a config's flags doubles its token gap, so the matrix must find the
slow config significantly worse and record each run's server flags.
"""

from __future__ import annotations

import json

import pytest
from rundirs import StandIn

from servelab.bench.run import BenchOptions
from servelab.bench.workloads.request_plan import LoadSpec
from servelab.workflows import matrix
from servelab.workflows.matrix import MatrixSpec, execute_matrix, run_matrix


@pytest.fixture
def stand_in(monkeypatch):
    StandIn.started = []
    monkeypatch.setattr(matrix, "LaunchedServer", StandIn)
    return StandIn


def _base(tmp_path):
    return BenchOptions(
        workload="chat",
        load=LoadSpec(rate=40.0, requests=16, length_scale=0.2),
        out=tmp_path / "m",
        quiet=True,
        seed=3,
    )


def test_spec_parsing_and_errors(tmp_path):
    spec = MatrixSpec.parse({"configs": {"a": "--x 1", "b": None}, "repeats": 3})
    assert [c.name for c in spec.configs] == ["a", "b"] and spec.repeats == 3
    # Each repeat rotates the order, so no config always runs first.
    assert [(r, c.name) for r, c in spec.order()] == [
        (0, "a"),
        (0, "b"),
        (1, "b"),
        (1, "a"),
        (2, "a"),
        (2, "b"),
    ]
    with pytest.raises(ValueError, match="at least two configs"):
        MatrixSpec.parse({"configs": {"a": ""}})
    with pytest.raises(ValueError, match="repeats"):
        MatrixSpec.parse({"configs": {"a": "", "b": ""}, "repeats": 0})
    with pytest.raises(ValueError, match="config name"):
        MatrixSpec.parse({"configs": {"a/b": "", "b": ""}})
    with pytest.raises(ValueError, match="unknown key"):
        MatrixSpec.parse({"configs": {"a": "", "b": ""}, "repeat": 2})
    path = tmp_path / "m.yaml"
    path.write_text("repeats: 2\nconfigs:\n  fast: ''\n  slow: {engine_args: --slow}\n")
    assert [c.engine_args for c in MatrixSpec.load(path).configs] == ["", "--slow"]
    with pytest.raises(ValueError, match="no matrix file"):
        MatrixSpec.load(tmp_path / "missing.yaml")


def test_matrix_runs_interleaved_and_finds_the_slow_config(stand_in, tmp_path):
    spec = MatrixSpec.parse({"configs": {"fast": "", "slow": "--slow"}, "repeats": 2})
    res = execute_matrix(spec, _base(tmp_path))
    assert StandIn.started == ["", "--slow"]  # one server per config, started once
    assert [p.name for p in res.runs["fast"]] == ["fast-r0", "fast-r1"]
    assert set(res.exit_codes) == {"fast-r0", "slow-r0", "slow-r1", "fast-r1"}
    man = json.loads((res.out / "slow-r1" / "manifest.json").read_text())
    assert man["server"]["engine_args"] == "--slow" and man["server"]["config"] == {"slow": True}
    c = res.comparison
    assert c.labels == ["fast", "slow"]
    itl = c.row("itl", "p50")
    assert itl.delta[1] == pytest.approx(1.0, abs=0.3)
    assert itl.verdict(1) == "worse"
    # Same workload and model: comparable (a loaded machine may still mark a client invalid).
    assert not [w for w in c.warnings if "marked invalid" not in w]


def test_run_matrix_writes_report_and_json(stand_in, tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("configs:\n  fast: ''\n  slow: --slow\n")
    code = run_matrix(path, _base(tmp_path))
    assert code in (0, 3)  # 3: a loaded CI machine may mark a run's client invalid
    out = tmp_path / "m"
    body = json.loads((out / "matrix.json").read_text())
    assert body["order"] == ["fast-r0", "slow-r0"]
    html = (out / "report.html").read_text()
    assert 'data-section="comparison"' in html and html.count('data-section="summary"') == 2


def test_matrix_refuses_url(tmp_path):
    base = _base(tmp_path)
    base.url = "http://127.0.0.1:1"
    spec = MatrixSpec.parse({"configs": {"a": "", "b": ""}})
    with pytest.raises(ValueError, match="drop --url"):
        execute_matrix(spec, base)
    assert run_matrix(spec, base) == 2
