"""Steady state or over-saturated: per-window figures and the trend test on planted queues."""

from __future__ import annotations

import heapq
import json
import math
import random

import hypothesis.strategies as st
import numpy as np
import pytest
import rundirs
from client_records import client_records
from hypothesis import given, settings
from rich.console import Console

from servelab.analyze.diagnosis.diagnose import diagnose
from servelab.analyze.server_side.timeseries import ServerSeries
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


# --- the windows are binned, not rescanned: equal to a scan of every record per window --------


def _plain_timeslices(records, start, end, slice_duration, series=None):
    """Every window scans every record: the definition the binned version must equal."""
    from servelab.analyze.stats import describe
    from servelab.analyze.timeslices import PARTIAL_MIN, _end, _server_depth, saturation

    def pcts(vals):
        d = describe(vals, n_boot=0)
        return {"p50": d.p50, "p90": d.p90, "p99": d.p99}

    def step_mean(pts, a, b):
        total = 0.0
        for k, (t, v) in enumerate(pts):
            nxt = pts[k + 1][0] if k + 1 < len(pts) else math.inf
            lo, hi = max(a, t), min(b, nxt)
            if hi > lo:
                total += v * (hi - lo)
        covered = b - max(a, pts[0][0])
        return total / covered if covered > 0 else None

    inside = [r for r in records if start <= r.actual_send <= end]
    sends_end = max((r.actual_send for r in inside), default=start)
    span = sends_end - start
    n_full = int(span // slice_duration)
    edges = [start + k * slice_duration for k in range(n_full + 1)]
    if span - n_full * slice_duration >= PARTIAL_MIN * slice_duration or n_full == 0:
        edges.append(sends_end if n_full else max(sends_end, start + 1e-9))
    server = _server_depth(series)
    sends = np.array([r.actual_send for r in records])
    ends = np.array([_end(r) for r in records])
    slices = []
    for a, b in zip(edges, edges[1:]):
        last = b == edges[-1]
        sent = [r for r in inside if a <= r.actual_send < b or (last and r.actual_send == b)]
        ok = [r for r in sent if r.ok]
        completed = sum(r.ok and r.done is not None and a <= r.done < b for r in records)
        if server:
            depth = step_mean(server, a, b)
        else:
            overlap = np.clip(np.minimum(ends, b) - np.maximum(sends, a), 0.0, None)
            depth = float(overlap.sum() / (b - a)) if records else None
        slices.append(
            {
                "start": round(a - start, 6),
                "end": round(b - start, 6),
                "sent": len(sent),
                "ok": len(ok),
                "completed": completed,
                "offered_rate": sum(a <= r.intended_send < b for r in records) / (b - a),
                "achieved_rate": completed / (b - a),
                "queue_depth": depth,
                "ttft": pcts([x for r in ok if (x := r.ttft) is not None]),
                "itl": pcts([g for r in ok for g in r.itls]),
                "e2e": pcts([x for r in ok if (x := r.e2e) is not None]),
            }
        )
    offered_all = sum(start <= r.intended_send <= sends_end for r in records)
    done_all = sum(r.ok and r.done is not None and start <= r.done <= sends_end for r in records)
    offered = offered_all / span if span > 0 else None
    achieved = done_all / span if span > 0 else None
    return {
        "slice_duration_s": slice_duration,
        "depth_source": "server /metrics: waiting + running"
        if server
        else "client: requests in flight",
        "offered_rate": offered,
        "achieved_rate": achieved,
        "slices": slices,
        "saturation": saturation(slices, slice_duration, offered, achieved),
    }


def _window_args(recs, data):
    sends = [r.actual_send for r in recs] or [T0]
    start = data.draw(st.sampled_from([min(sends), T0, min(sends) + 7.0]))
    end = data.draw(st.sampled_from([max(sends), max(sends) - 5.0, start + 40.0]))
    return start, end, data.draw(st.sampled_from([1.0, 2.5, 10.0, 30.0]))


@settings(max_examples=300, deadline=None)
@given(client_records(dyadic=True), st.data())
def test_binned_windows_equal_the_scan_of_every_record(recs, data):
    start, end, dur = _window_args(recs, data)
    assert timeslices(recs, start, end, dur) == _plain_timeslices(recs, start, end, dur)


@settings(max_examples=200, deadline=None)
@given(client_records(), st.data())
def test_binned_windows_equal_the_scan_on_any_float_times(recs, data):
    """Only the client's in-flight depth sums its terms in another order: equal but for
    the last bits."""
    start, end, dur = _window_args(recs, data)
    got, want = timeslices(recs, start, end, dur), _plain_timeslices(recs, start, end, dur)
    for a, b in zip(got["slices"], want["slices"], strict=True):
        depth, want_depth = a.pop("queue_depth"), b.pop("queue_depth")
        assert depth == (want_depth and pytest.approx(want_depth, rel=1e-12))
        assert a == b
    for key in ("offered_rate", "achieved_rate", "depth_source"):
        assert got[key] == want[key]


@settings(max_examples=100, deadline=None)
@given(client_records(dyadic=True), st.data())
def test_binned_windows_equal_the_scan_with_a_server_series(recs, data):
    start, end, dur = _window_args(recs, data)
    n = data.draw(st.integers(2, 60))
    t = sorted(data.draw(st.lists(st.integers(0, 4000), min_size=n, max_size=n)))
    waiting = data.draw(st.lists(st.sampled_from([None, 0.0, 3.0, 7.5]), min_size=n, max_size=n))
    series = ServerSeries([T0 + k / 16 for k in t], {"waiting": waiting, "running": [1.0] * n})
    got = timeslices(recs, start, end, dur, series=series)
    assert got == _plain_timeslices(recs, start, end, dur, series=series)


def test_the_terminal_shows_at_most_120_windows_and_says_so():
    from servelab.analyze.summary import summarize
    from servelab.report.terminal import MAX_WINDOW_ROWS, slices_table

    short = summarize(queue_run(6.4, 1000.0, 0), n_boot=0, slice_duration=10.0)
    assert len(short["timeslices"]["slices"]) == 100
    assert slices_table(short).row_count == 100
    long = summarize(queue_run(6.4, 1500.0, 0), n_boot=0, slice_duration=10.0)
    table = slices_table(long)
    assert table.row_count == MAX_WINDOW_ROWS == 120
    assert "showing 120 of 150, evenly spaced" in str(table.title)
    console = Console(width=160, record=True)
    console.print(table)
    text = console.export_text()
    assert "0-10 " in text and "1490-1499" in text  # the first and the last windows
