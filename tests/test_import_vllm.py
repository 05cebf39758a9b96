"""`vllm bench serve`'s detailed result and vLLM's own OpenTelemetry spans of the same run,
imported: the client's chunk times rebuilt from its TTFT and ITL lists; the server's arrival,
first token, queue and prefill from its spans, inside the client's times; a twin is fitted to
the first and refused for the second."""

from __future__ import annotations

import json

import pytest
from test_import_runs import DATA, SAMPLES, import_sample
from typer.testing import CliRunner

from servelab.bench.imports import UnreadableImport, import_file, vllm_bench
from servelab.cli import app
from servelab.rundir import load_run

BENCH = json.loads(SAMPLES["vllm"][0].read_text())


def test_each_request_keeps_vllm_bench_s_ttft_itls_and_latency(tmp_path):
    run = load_run(import_sample(tmp_path, "vllm"))
    assert len(run.records) == len(BENCH["start_times"])
    order = sorted(range(len(BENCH["start_times"])), key=lambda i: BENCH["start_times"][i])
    for rec, i in zip(run.records, order, strict=True):
        assert rec.actual_send == BENCH["start_times"][i]
        assert rec.ttft == pytest.approx(BENCH["ttfts"][i], abs=1e-9)
        assert rec.itls == pytest.approx(BENCH["itls"][i], abs=1e-9)
        assert rec.e2e == pytest.approx(BENCH["latencies"][i], abs=1e-9)
        assert rec.send_lag == 0  # a closed loop (rate inf, 4 streams): due when sent
        assert rec.output_tokens == BENCH["output_lens"][i] == sum(rec.chunk_tokens)


def test_a_closed_loop_is_replayed_as_one_and_a_rate_s_queueing_is_client_lag(tmp_path):
    assert BENCH["request_rate"] == "inf" and BENCH["max_concurrency"] == 4
    run = load_run(import_sample(tmp_path, "vllm"))
    assert run.manifest["config"]["load"]["concurrency"] == 4
    paced = tmp_path / "paced.json"
    paced.write_text(json.dumps({**BENCH, "request_rate": 2.0}))
    imp = vllm_bench.read(paced)
    assert imp.concurrency is None
    lags = sorted(r.send_lag for r in imp.records)
    assert lags == pytest.approx(sorted(BENCH["queue_times"]))


def test_calibrate_fits_a_twin_to_a_vllm_bench_run(tmp_path):
    run_dir = import_sample(tmp_path, "vllm", "--server-config", "vllm serve M --max-num-seqs 8")
    out = tmp_path / "twin.json"
    r = CliRunner().invoke(app, ["calibrate", str(run_dir), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["server"] == "vllm"


def test_a_result_without_per_request_lists_says_how_to_save_them(tmp_path):
    summary_only = {k: v for k, v in BENCH.items() if k not in ("start_times", "itls")}
    src = tmp_path / "summary.json"
    src.write_text(json.dumps(summary_only))
    with pytest.raises(UnreadableImport, match="--save-detailed"):
        import_file(src, tmp_path / "run", command=["servelab", "import"])


def test_vllm_s_spans_are_the_server_s_side_of_the_same_requests(tmp_path):
    spans = load_run(import_sample(tmp_path, "otel"))
    client = load_run(import_sample(tmp_path, "vllm"))
    assert len(spans.records) == len(client.records)
    # vllm bench sent "vb-<index>"; vLLM's span names the request "cmpl-vb-<index>-0"
    by_index = {int(r.server_request_id.split("-")[2]): r for r in spans.records}
    for rec, i in zip(
        client.records, sorted(by_index, key=lambda i: BENCH["start_times"][i]), strict=True
    ):
        server = by_index[i]
        assert server.ttft <= rec.ttft  # the server's TTFT lies inside the client's
        assert server.output_tokens == rec.output_tokens
        figs = server.server_timeline
        assert figs["reported_by"] == "vllm otel span"
        assert figs["queue_time"] + figs["prefill_time"] <= server.ttft
    # the spans keep each request's first and last token times: the twin is fitted to them
    r = CliRunner().invoke(app, ["calibrate", str(spans.path), "--out", str(tmp_path / "c")])
    assert r.exit_code == 0 and "first and last only" in " ".join(r.output.split())
    assert json.loads((tmp_path / "c").read_text())["fit"]["token_times"] == "first_and_last"


def test_spans_without_a_request_span_are_refused(tmp_path):
    first = (DATA / "vllm-otel.jsonl").read_text().splitlines()[0]  # vLLM's start-up spans
    src = tmp_path / "startup.jsonl"
    src.write_text(first + "\n")
    with pytest.raises(UnreadableImport, match="no vLLM llm_request span"):
        import_file(src, tmp_path / "run", command=["servelab", "import"])
