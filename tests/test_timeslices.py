"""Steady state or over-saturated: per-window figures and the trend test on planted queues."""

from __future__ import annotations

import heapq
import json
import random

import pytest
import rundirs
from rich.console import Console

from servelab.analyze.diagnose import diagnose
from servelab.analyze.timeseries import ServerSeries
from servelab.analyze.timeslices import kendall_p_rising, timeslices, trend
from servelab.report.terminal import render_diagnosis
from servelab.rundir import load_run
from servelab.vocab import ClientRecord

T0 = 1000.0


def queue_run(rate: float, duration: float, seed: int, servers: int = 8) -> list[ClientRecord]:
    """Poisson arrivals on ``servers`` FIFO servers of ~1 s each (capacity 8 req/s):
    above capacity the queue grows linearly with time."""
    rng = random.Random(seed)
    free = [T0] * servers
    recs, t = [], T0
    while (t := t + rng.expovariate(rate)) - T0 <= duration:
        begin = max(t, heapq.heappop(free))
        svc = rng.uniform(0.8, 1.2)
        first, done = begin + 0.2 * svc, begin + svc
        heapq.heappush(free, done)
        chunks = [first + (done - first) * i / 9 for i in range(10)]
        recs.append(
            ClientRecord(
                request_id=f"r{len(recs)}",
                workload_class="chat",
                intended_send=t,
                actual_send=t,
                input_tokens=100,
                output_tokens=10,
                chunk_times=chunks,
                chunk_tokens=[1] * 10,
                done=done,
                status=200,
            )
        )
    return recs


def verdict(recs: list[ClientRecord], **kw) -> dict:
    return timeslices(recs, recs[0].actual_send, max(r.done for r in recs), **kw)


@pytest.mark.parametrize("seed", range(5))
def test_a_queue_that_grows_linearly_is_over_saturated(seed):
    ts = verdict(queue_run(12.0, 60.0, seed))  # 1.5x capacity
    sat = ts["saturation"]
    assert sat["state"] == "over_saturated" and sat["length_dependent"] is True
    assert ts["achieved_rate"] == pytest.approx(8.0, rel=0.15)
    assert ts["offered_rate"] == pytest.approx(12.0, rel=0.15)
    # the queue grows at offered - achieved, about 4 requests/s
    assert sat["queue_depth_trend"]["slope_per_minute"] == pytest.approx(240, rel=0.3)
    assert sat["ttft_p50_trend"]["p_rising"] < 0.01


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("rate", [6.4, 7.6])  # 80% and 95% of capacity
def test_a_steady_run_at_high_load_is_not(seed, rate):
    ts = verdict(queue_run(rate, 120.0, seed))
    assert ts["saturation"]["state"] == "steady"
    assert ts["saturation"]["length_dependent"] is False
    assert ts["achieved_rate"] == pytest.approx(ts["offered_rate"], rel=0.1)


def test_a_short_run_cannot_tell():
    ts = verdict(queue_run(12.0, 25.0, 0))
    assert ts["saturation"]["state"] == "undetermined"
    assert ts["saturation"]["length_dependent"] is None
    assert "needs >= 4 windows" in ts["saturation"]["reason"]
    # smaller windows make the same run long enough to judge
    assert verdict(queue_run(12.0, 25.0, 0), slice_duration=4.0)["saturation"]["state"] == (
        "over_saturated"
    )


def test_slices_hold_per_window_percentiles_and_rates():
    recs = queue_run(6.4, 45.0, 1)
    ts = verdict(recs)
    sl = ts["slices"]
    assert [s["start"] for s in sl] == [0.0, 10.0, 20.0, 30.0]  # last partial < half: dropped
    for s in sl:
        inside = [
            r.ttft for r in recs if s["start"] <= r.actual_send - recs[0].actual_send < s["end"]
        ]
        assert s["sent"] == len(inside)
        assert s["ttft"]["p50"] == pytest.approx(sorted(inside)[len(inside) // 2], rel=0.2)
        assert s["offered_rate"] == pytest.approx(s["sent"] / 10.0, abs=0.31)
        assert 0 < s["queue_depth"] < 12
    assert ts["depth_source"].startswith("client")


def test_queue_depth_comes_from_the_server_series_where_it_has_one():
    recs = queue_run(12.0, 60.0, 0)
    t = [T0 + k for k in range(0, 62)]
    flat = ServerSeries(t, {"waiting": [5.0] * len(t), "running": [8.0] * len(t)})
    ts = verdict(recs, series=flat)
    assert ts["depth_source"].startswith("server")
    assert all(s["queue_depth"] == pytest.approx(13.0) for s in ts["slices"])
    # a server that says its queue held flat outweighs the client's growing in-flight count
    assert ts["saturation"]["state"] == "steady"


def test_kendall_exact_null_and_trend_size():
    assert kendall_p_rising([1, 2, 3, 4]) == (6, pytest.approx(1 / 24))
    assert kendall_p_rising([4, 3, 2, 1])[1] == pytest.approx(1.0)
    s, p = kendall_p_rising(list(range(40)))  # the normal approximation above 30 points
    assert s == 780 and p < 1e-9
    # significant but small: a queue fluctuating around 10 that drifts by 2 does not rise
    tr = trend([0, 1, 2, 3, 4, 5], [10, 10.2, 10.5, 11, 11.5, 12])
    assert tr.p < 0.05 and not tr.rising


def test_diagnose_names_over_saturation_only_when_planted(tmp_path):
    over = rundirs.write_run(
        tmp_path / "over", rundirs.chat_requests(1100, 25.0, 0), rundirs.Engine(max_num_seqs=4)
    )
    d = diagnose(load_run(over))
    f = {f.id: f for f in d.findings}["over_saturated"]
    assert f.evidence["offered_rate"] > 1.3 * f.evidence["achieved_rate"]
    assert f.evidence["ttft_p50_growth_ms_per_minute"] > 0
    assert "capacity" in {r.lever for r in d.recommendations}
    assert d.timeslices["saturation"]["state"] == "over_saturated"
    # A run recorded before time windows: computed from its records and recorded flag.
    m = json.loads((over / "metrics.json").read_text())
    del m["timeslices"]
    (over / "metrics.json").write_text(json.dumps(m))
    man = json.loads((over / "manifest.json").read_text())
    man["config"] = {"slice_duration": 5.0}
    (over / "manifest.json").write_text(json.dumps(man))
    old = diagnose(load_run(over))
    assert old.timeslices["slice_duration_s"] == 5.0
    assert "over_saturated" in {f.id for f in old.findings}
    console = Console(width=120, record=True)
    render_diagnosis(old, console)
    assert "over-saturated: offered" in console.export_text()
    steady = rundirs.write_run(
        tmp_path / "steady", rundirs.chat_requests(540, 12.0, 0), rundirs.Engine(max_num_seqs=4)
    )
    assert "over_saturated" not in {f.id for f in diagnose(load_run(steady)).findings}


def test_terminal_and_report_say_length_dependent():
    from servelab.analyze.summary import summarize
    from servelab.report.html import timeslices_html
    from servelab.report.terminal import saturation_line, slices_table, summary_table

    over = summarize(queue_run(12.0, 60.0, 0), n_boot=0)
    steady = summarize(queue_run(6.4, 60.0, 0), n_boot=0)
    console = Console(width=120, record=True)
    console.print(summary_table("latency", over))
    console.print(slices_table(over))
    console.print(saturation_line(over))
    text = console.export_text()
    assert "over-saturated: percentiles depend on the run's length" in text
    assert "0-10" in text and "50-59.84" in text and "offered 11.6 req/s" in text
    assert "length-dependent" in timeslices_html(over)
    assert "Over-saturated" in timeslices_html(over)
    assert "Steady state: offered" in timeslices_html(steady)
    assert saturation_line(steady).startswith("steady state: offered")
