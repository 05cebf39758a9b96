"""/metrics as a time series: the scraper against the test server, and what analysis reads."""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path

import pytest

from servelab.analyze.server_side.promscrape import estimate, info_metrics, parse_scrapes
from servelab.analyze.server_side.timeseries import server_series
from servelab.bench.servers.collect import MetricsScraper
from servelab.rundir import RunDir
from servelab.testing.testserver import Schedule, TestServer


def _scrape(tmp_path, schedule: Schedule, period: float, seconds: float):
    async def go(url):
        rd = RunDir(tmp_path / "run")
        sc = MetricsScraper(url, rd, {}, period)
        await sc.start()
        await asyncio.sleep(seconds)
        await sc.stop()
        rd.close()
        return sc

    server = TestServer(schedule)
    with server.running() as url:
        sc = asyncio.run(go(url))
    return sc, server


def test_scrapes_every_interval_into_the_run_directory(tmp_path):
    sc, server = _scrape(tmp_path, Schedule(), 0.1, 1.0)
    # start + about one per interval + stop; never more calls than stored scrapes
    assert 6 <= sc.scrapes <= 13 and server.metrics_scrapes == sc.scrapes
    rep = sc.report(1.0)
    assert rep["note"] is None and rep["interval_s"] == 0.1 and 0 < rep["share_of_wall"] < 1
    lines = (tmp_path / "run" / "metrics_scrape.jsonl").read_text().splitlines()
    assert len(lines) == sc.scrapes and "vllm:num_requests_running" in json.loads(lines[0])["text"]


@pytest.mark.parametrize(
    ("mode", "calls", "note"),
    [("missing", 1, "HTTP 404"), ("malformed", 1, "not Prometheus text")],
)
def test_a_missing_or_malformed_endpoint_is_noted_once_and_left_alone(tmp_path, mode, calls, note):
    sc, server = _scrape(tmp_path, Schedule(metrics=mode), 0.1, 0.5)
    assert sc.scrapes == 0 and server.metrics_scrapes == calls
    assert note in sc.note


def test_a_slow_endpoint_backs_off(tmp_path):
    sc, _ = _scrape(tmp_path, Schedule(metrics="slow"), 0.2, 1.5)
    assert "took over" in sc.note and sc.period > 0.2
    assert sc.scrapes == 0


def _scrape_text(t, waiting, running, kv, pre, queries, hits):
    return {
        "t": t,
        "text": (
            f"vllm:num_requests_waiting {waiting}\n"
            f"vllm:num_requests_running {running}\n"
            f"vllm:kv_cache_usage_perc {kv}\n"
            f"vllm:num_preemptions_total {pre}\n"
            f"vllm:prefix_cache_queries_total {queries}\n"
            f"vllm:prefix_cache_hits_total {hits}\n"
        ),
    }


def test_series_reads_gauges_windows_and_counter_deltas():
    # Counters start high: the server ran before this run.
    scrapes = [
        _scrape_text(
            10.0 + 0.5 * k, k, 4, 0.5 + 0.05 * k, 7 + (k >= 6), 1000 + 100 * k, 900 + 25 * k
        )
        for k in range(10)
    ]
    scrapes.insert(3, {"t": 11.6, "text": "garbage {{{"})  # skipped, not fatal
    s = server_series(parse_scrapes(scrapes))
    assert s is not None and len(s.t) == 10 and s.interval == pytest.approx(0.5)
    assert s.at("waiting", 11.2) == 2 and s.peak("kv_usage", 10.0, 14.5) == pytest.approx(0.95)
    assert s.increases("preemptions") == [(12.5, 13.0, 1.0)]
    assert (
        s.rose_during("preemptions", 12.8, 12.9) == 1.0
        and s.rose_during("preemptions", 10, 12) == 0
    )
    assert s.prefix_hit_rate() == pytest.approx(0.25)
    assert s.trend_per_minute("waiting") == pytest.approx(120.0)
    d = s.to_dict()
    assert d["preemption_windows"] == [[12.5, 13.0, 1.0]] and d["scrapes_with_kv_above_90pct"] == 2


def test_too_few_or_foreign_scrapes_give_no_series():
    assert server_series(parse_scrapes([_scrape_text(1.0, 0, 0, 0, 0, 0, 0)])) is None
    other = [{"t": t, "text": "up 1\n"} for t in (1.0, 2.0)]
    assert server_series(parse_scrapes(other)) is None


def test_bench_against_a_vllm_like_server_keeps_its_figures_and_series(tmp_path):
    import subprocess
    import sys

    from servelab.analyze.diagnosis.diagnose import diagnose
    from servelab.rundir import load_run, read_records
    from servelab.testing.testserver import run_test_server

    out = tmp_path / "run"
    sched = Schedule(ttft=0.06, queue=0.02, itl=0.01, report="vllm")
    with run_test_server(sched) as url:
        p = subprocess.run(
            [sys.executable, "-m", "servelab.cli", "bench", "--url", url, "--workload", "chat",
             "--requests", "6", "--concurrency", "2", "--scrape-interval", "100ms",
             "--out", str(out), "--quiet"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    assert p.returncode in (0, 3), p.stderr + p.stdout
    recs = read_records(out / "requests.jsonl")
    assert all(r.server_timeline["reported_by"] == "vllm metrics" for r in recs)
    manifest = json.loads((out / "manifest.json").read_text())
    scrape = manifest["stages"][0]["plan"]["scrape"]
    assert scrape["interval_s"] == 0.1 and scrape["scrapes"] >= 2 and scrape["note"] is None
    d = diagnose(load_run(out))
    assert d.source == "reported" and d.server_series["scrapes"] == scrape["scrapes"]
    assert all(b.queue == pytest.approx(0.02, abs=0.01) for b in d.attribution.ttft)


def test_bad_scrape_interval_is_one_line(tmp_path):
    from typer.testing import CliRunner

    from servelab.cli import app

    r = CliRunner().invoke(app, ["bench", "--url", "http://127.0.0.1:9", "--scrape-interval", "0s"])
    assert r.exit_code != 0 and "--scrape-interval" in r.output and "Traceback" not in r.output


# ---------------------------------------------------------------- recorded from vLLM 0.32 CPU
# Three scrapes of vLLM 0.32's /metrics (CPU build, SmolLM2-135M): before any request, while
# one request ran, and after 10 requests had finished.
def _recorded() -> list[dict]:
    base = Path(__file__).parent / "fixtures" / "vllm"
    return [
        {
            "t": float(i),
            "text": gzip.decompress((base / f"metrics{i}.prom.gz").read_bytes()).decode(),
        }
        for i in range(3)
    ]


def test_recorded_vllm_scrapes_give_the_series():
    s = server_series(parse_scrapes(_recorded()))
    assert s is not None
    assert s.gauges["running"] == [0.0, 1.0, 0.0] and s.gauges["waiting"] == [0.0, 0.0, 0.0]
    assert 0.0 < s.peak("kv_usage", 0.0, 2.0) < 0.01  # a fraction of the cache, not percent
    assert s.delta("prefix_cache_queries") == 682.0 and s.prefix_hit_rate() == 0.0
    assert s.increases("preemptions") == []


def test_recorded_vllm_scrapes_give_every_histogram_and_sane_quantiles():
    est = estimate(_recorded())
    assert est is not None
    # vLLM 0.32 names TPOT vllm:request_time_per_output_token_seconds.
    assert set(est.histograms) == {"ttft", "queue", "prefill", "decode", "itl", "tpot", "e2e"}
    assert {h.count for k, h in est.histograms.items() if k != "itl"} == {10.0}
    queue = est.histograms["queue"]
    # Every queue time fell in vLLM's first bucket (0-0.3 s) with a mean of microseconds: the
    # quantile is that mean, not the bucket's middle.
    assert queue.mean < 1e-3 and queue.quantile(0.5) == pytest.approx(queue.mean)
    for h in est.histograms.values():
        assert h.quantile(0.5) <= h.quantile(0.9)


def test_recorded_vllm_scrape_describes_its_cache_config():
    info = info_metrics(_recorded()[0]["text"])
    assert set(info) == {"vllm:cache_config_info"}  # python_info is the client library's
    cache = info["vllm:cache_config_info"]
    assert cache["block_size"] == "128" and cache["enable_prefix_caching"] == "True"
    assert int(cache["num_gpu_blocks"]) * 128 == int(cache["kv_cache_size_tokens"])
