"""What a CI reads from a run: the shipped JSON Schemas hold for real run directories,
`compare --fail-on` fails only on a regression beyond its threshold that is significant, and
`export` writes the requests as CSV or Parquet."""

from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from servelab import schemas
from servelab.analyze.summary import summarize
from servelab.cli import app
from servelab.rundir import RunDir, write_json
from servelab.testing.testserver import Schedule, TestServer
from servelab.units import SLO
from servelab.vocab import ClientRecord

jsonschema = pytest.importorskip("jsonschema")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "servelab.cli", *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={**os.environ, "COLUMNS": "160"},
    )


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """A single-load bench run, a two-stage sweep, and a simulated run."""
    root = tmp_path_factory.mktemp("runs")
    runs = {}
    with TestServer(Schedule(ttft=0.005, itl=0.001)).running() as url:
        for name, extra in (
            ("single", ["--requests", "12", "--concurrency", "3"]),
            ("sweep", ["--sweep", "concurrency=1,2", "--requests", "4"]),
        ):
            p = _cli("bench", "--url", url, "--out", str(root / name), *extra)
            # 3: a valid run directory whose client fell behind (2 busy cores); still a run
            assert p.returncode in (0, 3), p.stdout + p.stderr
            runs[name] = root / name
    p = _cli(
        "sim", "--hardware", "h100", "--model", "qwen2.5-7b", "--workload", "chat",
        "--rate", "4", "--requests", "10", "--out", str(root / "sim"),
    )  # fmt: skip
    if p.returncode == 0:  # the simulator plans with the default model's tokenizer
        runs["sim"] = root / "sim"
    return runs


def _validate(name: str, doc) -> None:
    jsonschema.Draft202012Validator(schemas.schema(name)).validate(doc)


def test_the_schemas_are_valid_and_versioned():
    for name in schemas.NAMES:
        s = schemas.schema(name)
        jsonschema.Draft202012Validator.check_schema(s)
        assert s["$id"].endswith(f":v{schemas.SCHEMA_VERSION}")
        assert schemas.path(name).name == f"{name}.v{schemas.SCHEMA_VERSION}.schema.json"


def test_real_run_directories_match_the_schemas(real_runs):
    assert {"single", "sweep"} <= set(real_runs)
    for run in real_runs.values():
        _validate("manifest", json.loads((run / "manifest.json").read_text()))
        _validate("metrics", json.loads((run / "metrics.json").read_text()))
        lines = (run / "requests.jsonl").read_text().splitlines()
        assert lines
        for line in lines:
            _validate("request", json.loads(line))


def test_the_schemas_reject_what_a_ci_would_misread(real_runs):
    metrics = json.loads((real_runs["single"] / "metrics.json").read_text())
    del metrics["overall"]["throughput"]["output_tokens_per_s"]
    with pytest.raises(jsonschema.ValidationError):
        _validate("metrics", metrics)
    line = json.loads((real_runs["single"] / "requests.jsonl").read_text().splitlines()[0])
    with pytest.raises(jsonschema.ValidationError):
        _validate("request", {**line, "token_source": "guess"})


# --- compare --fail-on -------------------------------------------------------------------


def _synthetic_run(path: Path, seed: int, ttft_scale: float = 1.0, n: int = 200) -> Path:
    """``n`` requests, TTFT lognormal around 100 ms (times ``ttft_scale``), 10 chunks 20 ms apart."""
    rng = random.Random(seed)
    rd = RunDir(path)
    recs = []
    for i in range(n):
        send = 1000.0 + 0.1 * i
        first = send + rng.lognormvariate(-2.3, 0.3) * ttft_scale
        times = [first + 0.02 * k for k in range(10)]
        rec = ClientRecord(
            request_id=f"r{i}",
            workload_class="chat",
            intended_send=send,
            actual_send=send,
            input_tokens=100,
            output_tokens=10,
            chunk_times=times,
            chunk_tokens=[1] * 10,
            done=times[-1],
            status=200,
        )
        rd.add_record(rec)
        recs.append(rec)
    rd.close()
    write_json(path / "metrics.json", summarize(recs, slos=SLO.parse("ttft=150ms"), n_boot=50))
    return path


@pytest.fixture(scope="module")
def gate_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate")
    return {
        "base": _synthetic_run(root / "base", seed=1),
        "noise": _synthetic_run(root / "noise", seed=2),
        "slower": _synthetic_run(root / "slower", seed=3, ttft_scale=1.4),
        "small": _synthetic_run(root / "small", seed=4, ttft_scale=1.2, n=6),
    }


RULES = "ttft.p99:+10%,goodput:-5%"


def _compare(*args: str):
    return CliRunner().invoke(app, ["compare", *args])


def test_fail_on_passes_a_difference_within_noise(gate_runs):
    r = _compare(str(gate_runs["base"]), str(gate_runs["noise"]), "--fail-on", RULES)
    assert r.exit_code == 0, r.output
    assert "pass noise: ttft.p99" in r.output and "pass noise: goodput" in r.output
    assert "FAIL" not in r.output


def test_fail_on_fails_a_planted_regression_and_says_why(gate_runs):
    r = _compare(str(gate_runs["base"]), str(gate_runs["slower"]), "--fail-on", RULES)
    assert r.exit_code == 1, r.output
    fails = [ln for ln in r.output.splitlines() if ln.startswith("FAIL")]
    assert any("ttft.p99" in ln and "beyond +10% and significant" in ln for ln in fails)
    assert any("goodput" in ln and "REGRESSION" in ln for ln in fails)


def test_fail_on_passes_a_change_beyond_the_threshold_that_is_not_significant(gate_runs):
    r = _compare(str(gate_runs["base"]), str(gate_runs["small"]), "--fail-on", "ttft.p50:+5%")
    assert r.exit_code == 0, r.output
    assert "beyond +5% but within noise" in r.output


def test_fail_on_rates_need_repeats_and_bad_rules_say_what_to_write(gate_runs):
    base, slower = str(gate_runs["base"]), str(gate_runs["slower"])
    r = _compare(base, slower, "--fail-on", "throughput:-1%")
    assert r.exit_code == 0 and ("not tested" in r.output or "within" in r.output)
    r = _compare(base, slower, "--fail-on", "ttft.p42:+10%")
    assert r.exit_code == 2 and "LATENCY.STAT" in r.output
    r = _compare(base, slower, "--fail-on", "ttft.p99>10")
    assert r.exit_code == 2 and "METRIC:+N%" in r.output


# --- export ------------------------------------------------------------------------------


def test_export_csv_has_one_row_per_request(real_runs, tmp_path):
    out = tmp_path / "t.csv"
    r = CliRunner().invoke(app, ["export", str(real_runs["single"]), "--out", str(out)])
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(out.open()))
    recs = [json.loads(x) for x in (real_runs["single"] / "requests.jsonl").read_text().split()]
    assert [row["request_id"] for row in rows] == [x["request_id"] for x in recs]
    first = rows[0]
    ttft = recs[0]["chunk_times"][0] - recs[0]["actual_send"]
    assert float(first["ttft"]) == pytest.approx(ttft) and first["ok"] == "True"


def test_export_parquet_or_a_clear_message(real_runs, tmp_path, monkeypatch):
    out = tmp_path / "t.parquet"
    args = ["export", str(real_runs["single"]), "--format", "parquet", "--out", str(out)]
    try:
        import pyarrow.parquet as pq
    except ImportError:
        pq = None
    if pq is not None:
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, r.output
        table = pq.read_table(out)
        n = len((real_runs["single"] / "requests.jsonl").read_text().splitlines())
        assert table.num_rows == n and table.schema.field("ttft").type == "double"
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "pyarrow" else real(n, *a)
    )
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and "Parquet needs pyarrow" in r.output
