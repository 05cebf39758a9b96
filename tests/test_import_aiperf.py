"""AIPerf's records imported: each chunk's time rebuilt from AIPerf's own TTFT and inter-chunk
gaps, its X-Request-Id kept; calibrate fits vLLM's twin to it and tune replays it."""

from __future__ import annotations

import json

import pytest
from test_import_runs import SAMPLES, import_sample
from typer.testing import CliRunner

from servelab.cli import app
from servelab.rundir import load_run

ROWS = [json.loads(line) for line in (SAMPLES["aiperf"][0] / "profile_export.jsonl").open()]
VLLM = "vllm serve smollm2-135m --enforce-eager --max-num-seqs 8"


def test_each_request_keeps_aiperf_s_ttft_gaps_and_id(tmp_path):
    run = load_run(import_sample(tmp_path, "aiperf"))
    by_id = {r.sent_request_id: r for r in run.records}
    assert len(run.records) == len(ROWS)
    for row in ROWS:
        m = row["metrics"]
        rec = by_id[row["metadata"]["x_request_id"]]
        assert rec.ttft == pytest.approx(m["time_to_first_token"]["value"] / 1e3, abs=1e-6)
        assert rec.itls == pytest.approx(
            [g / 1e3 for g in m["inter_chunk_latency"]["value"]], abs=1e-6
        )
        assert rec.output_tokens == m["output_sequence_length"]["value"]
        assert rec.send_lag >= 0  # AIPerf's credit is issued before the send
    assert run.metrics["overall"]["latency"]["itl"]["n"] == sum(
        len(r["metrics"]["inter_chunk_latency"]["value"]) for r in ROWS
    )


def test_calibrate_fits_the_twin_of_the_stated_server(tmp_path):
    run_dir = import_sample(tmp_path, "aiperf", "--server-config", VLLM)
    out = tmp_path / "twin.json"
    r = CliRunner().invoke(app, ["calibrate", str(run_dir), "--out", str(out)])
    assert r.exit_code == 0, r.output
    cal = json.loads(out.read_text())
    assert cal["server"] == "vllm" and cal["engine_config"]["max_num_seqs"] == 8
    assert cal["fit"]["rows"] >= 8 and cal["cost"]["decode_seqs"] + cal["cost"]["step"] > 0


def test_tune_replays_the_imported_run_on_its_twin(tmp_path):
    # moved after the import: the replay finds the run's trace inside the directory
    run_dir = import_sample(tmp_path, "aiperf", "--server-config", VLLM).rename(tmp_path / "moved")
    r = CliRunner().invoke(app, ["tune", str(run_dir), "--seeds", "2", "--json", "--ignore-gates"])
    assert r.exit_code == 0, r.output
    tuning = json.loads(r.output)
    check = tuning["self_check"]
    assert check["rows"] and {row["figure"] for row in check["rows"]} >= {"ttft_p50", "itl_p50"}
