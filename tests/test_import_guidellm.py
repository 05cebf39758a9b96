"""GuideLLM's results JSON imported: every request's send, TTFT and end as GuideLLM timed them,
vLLM's per-request metrics that GuideLLM passed through, no per-token times (so no ITL, and a
twin fitted to first and last token times), errors kept."""

from __future__ import annotations

import json

import pytest
from test_import_runs import DATA, SAMPLES, import_sample
from typer.testing import CliRunner

from servelab.bench.imports import guidellm
from servelab.cli import app
from servelab.rundir import load_run


def _requests(path):
    return json.loads(path.read_text())["benchmarks"][0]["requests"]


def test_each_request_keeps_guidellm_s_own_times_counts_and_vllm_s_figures(tmp_path):
    run = load_run(import_sample(tmp_path, "guidellm"))
    ok = _requests(SAMPLES["guidellm"][0])["successful"]
    by_id = {r.response_id: r for r in run.records}
    assert len(run.records) == len(ok)
    assert [r.request_id for r in run.records] == [f"r{i:06d}" for i in range(len(ok))]
    for req in ok:
        rec = by_id[req["response_id"]]
        assert rec.ok
        assert rec.ttft == pytest.approx(req["time_to_first_token_ms"] / 1e3, abs=1e-6)
        assert rec.e2e == pytest.approx(req["request_latency"], abs=1e-6)
        assert (rec.input_tokens, rec.output_tokens) == (req["prompt_tokens"], req["output_tokens"])
        assert rec.itls == []  # GuideLLM keeps no time per token
        vllm = req["response_metrics"]
        assert rec.server_timeline["reported_by"] == "vllm metrics"
        assert rec.server_timeline["prefill_time"] == pytest.approx(
            vllm["time_to_first_token_ms"] / 1e3
        )
        # vLLM's prefill (scheduled -> first token) lies inside the client's TTFT
        assert rec.server_timeline["prefill_time"] < rec.ttft
    latency = run.metrics["overall"]["latency"]
    assert latency["ttft"]["n"] == len(ok) and latency["itl"]["n"] == 0


def test_the_diagnosis_splits_ttft_by_vllm_s_own_figures(tmp_path):
    r = CliRunner().invoke(app, ["diagnose", str(import_sample(tmp_path, "guidellm"))])
    assert r.exit_code == 0, r.output
    assert "attribution: reported" in r.output and "prefill compute" in r.output


def test_an_errored_request_keeps_guidellm_s_error():
    reqs = _requests(DATA / "guidellm-errored.json")
    imp = guidellm.read(DATA / "guidellm-errored.json")
    assert len(imp.records) == len(reqs["successful"]) + len(reqs["errored"])
    (bad,) = [r for r in imp.records if not r.ok]
    assert bad.request_id == reqs["errored"][0]["info"]["request_id"]
    assert "peer closed connection" in bad.error and bad.ttft is not None


def test_calibrate_fits_the_twin_from_first_and_last_token_times_and_says_so(tmp_path):
    run_dir = import_sample(tmp_path, "guidellm")
    r = CliRunner().invoke(app, ["calibrate", str(run_dir), "--out", str(tmp_path / "c.json")])
    assert r.exit_code == 0, r.output
    assert "first and last only" in " ".join(r.output.split())
    twin = json.loads((tmp_path / "c.json").read_text())
    assert twin["fit"]["token_times"] == "first_and_last" and twin["noise"] is None
    assert twin["fit"]["inference"]["decode_windows"] == len(load_run(run_dir).records)
    # tune's check fits the twin to part of the run: eight requests are too few for that
    r = CliRunner().invoke(app, ["tune", str(run_dir), "--ignore-gates"])
    assert r.exit_code == 0, r.output
    flat = " ".join(r.output.split())
    assert "fitted to each request's first and last token times" in flat
    assert "no prediction" in flat and "first and last token times; calibrate" in flat


def test_calibrate_refuses_a_run_with_no_decode_to_time(tmp_path):
    run_dir = import_sample(tmp_path, "guidellm")
    lines = (run_dir / "requests.jsonl").read_text().splitlines()
    rows = [json.loads(line) | {"output_tokens": 1} for line in lines]
    (run_dir / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = CliRunner().invoke(app, ["calibrate", str(run_dir), "--out", str(tmp_path / "c.json")])
    assert r.exit_code == 2, r.output
    assert "decode windows and idle prefills could be timed" in " ".join(r.output.split())
    assert not (tmp_path / "c.json").exists()
