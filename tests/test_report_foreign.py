"""The report of a run against another server: what the server said of its configuration,
per-request phases from its figures (marked where estimated), and no empty chart rows."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import pytest
import rundirs

from servelab.analyze.diagnosis.diagnose import diagnose
from servelab.bench.servers.target import probe
from servelab.report import charts
from servelab.report.html import write_report
from servelab.rundir import load_run
from servelab.testing.testserver import Schedule, TestServer


def _row_totals(fig) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for trace in fig.data:
        for y, x in zip(trace.y, trace.x):
            totals[y] += x
    return totals


@pytest.mark.parametrize("figures", [False, True])
def test_ttft_chart_has_no_empty_row(tmp_path, figures):
    run = load_run(rundirs.as_other_target(rundirs.burst(tmp_path / "o"), figures=figures))
    d = diagnose(run)
    fig = charts.ttft_attribution(d)
    totals = _row_totals(fig)
    assert set(totals) == {"all requests", "slowest 10%"} | {f"class {c}" for c in d.by_class}
    for row, table in {"all requests": d.overall, "slowest 10%": d.tail}.items():
        # Every row adds up to its TTFT from the intended send, split or not.
        whole = (table.ttft_mean + table.parts.get("client_lag", 0.0)) * 1e3
        assert totals[row] == pytest.approx(whole, rel=0.02)
    names = {t.name for t in fig.data}
    # Client-only: the per-request rows are not split; with vLLM's figures they are.
    assert (charts.UNSPLIT in names) is not figures


def test_phase_timeline_of_a_client_only_run_says_the_wait_is_not_split(tmp_path):
    run = load_run(rundirs.as_other_target(rundirs.burst(tmp_path / "o")))
    d = diagnose(run)
    names = {t.name for t in charts.phase_timeline(run, d.attribution.stalls).data}
    assert charts.PHASE_NAMES["unsplit"] in names
    assert charts.PHASE_NAMES["prefill"] not in names
    assert charts.PHASE_NAMES["queue"] not in names


def test_phase_timeline_places_the_servers_figures_back_from_the_first_token(tmp_path):
    run = load_run(rundirs.as_other_target(rundirs.burst(tmp_path / "o"), figures=True))
    d = diagnose(run)
    fig = charts.phase_timeline(run, d.attribution.stalls)
    by_name = {t.name: t for t in fig.data}
    prefill = by_name[charts.PHASE_NAMES["prefill" + charts.REPORTED]]
    queue = by_name[charts.PHASE_NAMES["queue" + charts.REPORTED]]
    assert charts.PHASE_NAMES["unsplit"] not in by_name
    assert prefill.line.dash == "dot" and queue.line.dash == "dot"  # drawn as estimated
    t0 = run.window[0]
    firsts = {
        f"{r.request_id} ({r.workload_class}, {r.input_tokens} in)": r.chunk_times[0] - t0
        for r in run.records
        if r.ok and r.chunk_times
    }
    ends = {y: x for x, y in zip(prefill.x[1::3], prefill.y[1::3])}
    assert ends and all(ends[y] == pytest.approx(firsts[y]) for y in ends)
    # The queue span ends where prefill starts, for every request.
    q_ends = dict(zip(queue.y[1::3], queue.x[1::3]))
    p_starts = dict(zip(prefill.y[0::3], prefill.x[0::3]))
    assert all(q_ends[y] == pytest.approx(p_starts[y]) for y in q_ends)


def test_probe_records_the_servers_info_metrics():
    with TestServer(Schedule(report="vllm")).running() as url:
        info = asyncio.run(probe(url))
    said = info.to_dict()
    assert said["info_metrics"] == {
        "vllm:cache_config_info": {"block_size": "16", "enable_prefix_caching": "True"}
    }
    assert said["max_model_len"] == info.max_model_len is not None


def test_probe_of_a_server_without_metrics_records_none():
    with TestServer(Schedule(report="vllm", metrics="malformed")).running() as url:
        info = asyncio.run(probe(url))
    assert info.info_metrics == {} and info.model_id is not None


def test_report_header_shows_what_the_server_said_of_itself(tmp_path):
    path = rundirs.as_other_target(rundirs.burst(tmp_path / "o"), figures=True)
    man = json.loads((path / "manifest.json").read_text())
    man["server"] |= {
        "version": {"version": "0.32.0"},
        "max_model_len": 2048,
        "info_metrics": {"vllm:cache_config_info": {"block_size": "16", "sliding_window": "None"}},
    }
    (path / "manifest.json").write_text(json.dumps(man))
    run = load_run(path)
    html = write_report([run], [diagnose(run)], tmp_path / "o.html").read_text()
    assert (
        "<b>server config</b> version=0.32.0; max_model_len=2048; "
        "vllm:cache_config_info: block_size=16<" in html
    )
