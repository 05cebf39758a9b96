"""The HTML report: every section, charts with titles/axes/legends, no network, and it
loads in headless Chromium without console errors (when Chromium is installed)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile

import pytest
import rundirs
from client_records import client_records
from hypothesis import given, settings
from plotly.offline import get_plotlyjs

from servelab.analyze.compare import compare
from servelab.analyze.diagnosis.diagnose import diagnose
from servelab.analyze.summary import run_summary
from servelab.report import charts
from servelab.report.html import RUN_SECTIONS, write_report
from servelab.rundir import load_run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("rep")
    stalls = load_run(rundirs.unchunked_stalls(base / "stalls"))
    a = load_run(rundirs.calm(base / "a", noise_seed=0))
    slow = load_run(rundirs.calm(base / "slow", noise_seed=2, slowdown=1.3))
    return {"stalls": stalls, "a": a, "slow": slow, "base": base}


@pytest.fixture(scope="module")
def single(runs):
    run = runs["stalls"]
    return write_report([run], [diagnose(run)], runs["base"] / "single.html")


@pytest.fixture(scope="module")
def multi(runs):
    rs = [runs["a"], runs["slow"]]
    return write_report(rs, [diagnose(r) for r in rs], runs["base"] / "multi.html", compare(rs))


def _sections(html: str) -> list[str]:
    return re.findall(r'data-section="([a-z-]+)"', html)


def test_single_run_report_has_every_section(single):
    html = single.read_text()
    assert _sections(html) == list(RUN_SECTIONS)
    assert "ITL spikes line up with long prefills" in html  # the finding
    assert "Turn chunked prefill on" in html  # its recommendation
    # One figure per chart section; a single-load run has a note instead of a sweep chart.
    assert html.count('class="plotly-graph-div"') == 6
    assert "ideal prefix reuse" in html and "Lengths sent" in html
    assert "Fewer than 3 load levels" in html


def test_multi_run_report_adds_the_comparison(multi):
    html = multi.read_text()
    secs = _sections(html)
    assert secs[0] == "comparison" and secs[1:] == list(RUN_SECTIONS) * 2
    assert "worse" in html and "noise" in html


def test_report_is_self_contained(single, multi):
    js = get_plotlyjs()
    for path in (single, multi):
        html = path.read_text()
        assert js in html  # plotly is inlined...
        rest = html.replace(js, "")
        assert "<script src" not in rest and "http://" not in rest and "https://" not in rest
        assert rest.count("Plotly.newPlot") >= 5


def test_every_chart_has_title_axes_and_legend(runs):
    run = runs["stalls"]
    d = diagnose(run)
    figs = [
        charts.ttft_vs_input(run),
        charts.itl_cdf(run),
        charts.latency_over_time(run),
        charts.ttft_attribution(d),
        charts.phase_timeline(run, d.attribution.stalls),
        charts.throughput_vs_latency(
            {
                "r": [
                    {
                        "stage": "s",
                        "throughput": 1.0,
                        "ttft_p50": 0.1,
                        "ttft_p99": 0.2,
                        "itl_p99": 0.05,
                    }
                ]
            }
        ),
        charts.percentile_bars(compare([run, run])),
    ]
    for fig in figs:
        lay = fig.layout
        assert lay.title.text and lay.showlegend
        assert lay.xaxis.title.text or any(
            getattr(lay, k).title.text for k in lay if k.startswith("xaxis")
        )
        assert lay.yaxis.title.text
        units = " ".join(
            str(getattr(lay, k).title.text) for k in lay if k.startswith(("xaxis", "yaxis"))
        )
        assert re.search(r"\((ms|s|tokens|tokens/s|ms, log)\)|requests|fraction|tokens|seqs", units)
        assert all(t.name for t in fig.data)


def test_phase_timeline_shows_queue_prefill_decode_and_steps(runs):
    run = runs["stalls"]
    fig = charts.phase_timeline(run, diagnose(run).attribution.stalls)
    names = {t.name for t in fig.data}
    assert {"prefill chunk", "decoding", "ITL stall (client view)"} <= names
    assert {"engine step: prefill tokens", "engine step: decode sequences"} <= names


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (CI installs it)")
def test_report_loads_in_headless_chromium_without_console_errors(multi):
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                f"--user-data-dir={profile}",
                "--enable-logging=stderr",
                "--v=0",
                "--virtual-time-budget=15000",
                "--dump-dom",
                multi.resolve().as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console
    dom = proc.stdout
    # Every figure drew its SVG: plotly writes one "main-svg" pair per plot.
    n_figs = dom.count('class="plotly-graph-div')
    assert n_figs >= 10 and dom.count('class="main-svg"') >= 2 * n_figs


def test_two_stage_sweep_draws_no_curve(tmp_path):
    run = load_run(rundirs.sweep(tmp_path / "sw"))
    assert run.stages == ["rate=4", "rate=16"]
    assert "overall" in run_summary(run)  # computed: a sweep's metrics.json is per stage
    pts = charts.stage_points(run)
    assert [p["stage"] for p in pts] == run.stages
    assert pts[1]["throughput"] > pts[0]["throughput"]
    out = write_report([run], [diagnose(run)], tmp_path / "sw.html")
    html = out.read_text()
    # Two points cannot show a curve's knee: the section says so instead of plotting.
    assert "Fewer than 3 load levels" in html
    assert (
        html.count('class="plotly-graph-div"') == 6
    )  # the five run charts and the lengths sent, no sweep curve


def test_report_for_another_server_uses_client_side_phases(tmp_path):
    run = load_run(rundirs.as_other_target(rundirs.burst(tmp_path / "o")))
    d = diagnose(run)
    html = write_report([run], [d], tmp_path / "o.html").read_text()
    assert _sections(html) == list(RUN_SECTIONS)
    assert "an estimate from /metrics histogram deltas" in html
    names = {t.name for t in charts.phase_timeline(run, d.attribution.stalls).data}
    assert "prefill chunk" not in names and {charts.PHASE_NAMES["unsplit"], "decoding"} <= names


# --- charts bin and sample large runs, and say so; small runs draw as before ------------------


def _run_of(recs, steps=()):
    from pathlib import Path

    from servelab.rundir import Run

    return Run(
        path=Path("mem"),
        manifest={"name": "mem"},
        records=list(recs),
        timelines={},
        steps=sorted(steps, key=lambda s: s.start),
    )


def _plain_over_time(run):
    """latency_over_time's series computed as their definitions read: masks per bin."""
    import itertools

    import numpy as np

    t0, t1 = run.window
    edges = charts._bins(t0, t1)
    mids = (edges[:-1] + edges[1:]) / 2 - t0
    ok = [r for r in run.records if r.ok and r.ttft is not None]
    sends = np.array([r.actual_send for r in ok])
    ttft = np.array([r.ttft for r in ok])
    series = []
    for q in (50, 95):
        ys = []
        for a, b in itertools.pairwise(edges):
            sel = ttft[(sends >= a) & (sends < b)]
            ys.append(float(np.percentile(sel, q)) * 1e3 if len(sel) else None)
        series.append(ys)
    gaps_t = np.array([t for r in ok for t in r.chunk_times[1:]])
    gaps_v = np.array([g for r in ok for g in r.itls])
    if len(gaps_v):
        ys = []
        for a, b in itertools.pairwise(edges):
            sel = gaps_v[(gaps_t >= a) & (gaps_t < b)]
            ys.append(float(np.percentile(sel, 99)) * 1e3 if len(sel) else None)
        series.append(ys)
    series.append(
        [
            sum(1 for r in run.records if r.actual_send <= m + t0 <= (r.done or r.actual_send))
            for m in mids
        ]
    )
    return series


@settings(max_examples=150, deadline=None)
@given(client_records(max_size=40).filter(bool))
def test_latency_over_time_bins_equal_masks_per_bin(recs):
    fig = charts.latency_over_time(_run_of(recs))
    assert [list(t.y) for t in fig.data] == _plain_over_time(_run_of(recs))


def _big_run(n):
    from servelab.vocab import ClientRecord, StepRecord

    recs = [
        ClientRecord(
            request_id=f"r{i}",
            workload_class="chat" if i % 3 else "rag",
            intended_send=1000.0 + i * 0.01,
            actual_send=1000.0 + i * 0.01,
            input_tokens=100 + i % 700,
            output_tokens=3,
            chunk_times=[1000.0 + i * 0.01 + 0.05 + (i % 97) * 1e-3 + k * 0.02 for k in range(3)],
            chunk_tokens=[1, 1, 1],
            done=1000.0 + i * 0.01 + 0.2,
        )
        for i in range(n)
    ]
    steps = [
        StepRecord(step_id=k, start=1000.0 + k * 0.004, end=1000.0 + k * 0.004 + 0.003,
                   prefill_tokens=k % 50, decode_seqs=k % 7, num_waiting=k % 11)
        for k in range(int(n * 0.01 / 0.004))
    ]  # fmt: skip
    return _run_of(recs, steps)


def test_large_runs_are_sampled_and_binned_and_say_so():
    run = _big_run(12_000)  # 30,000 steps
    fig = charts.ttft_vs_input(run)
    shown = sum(len(t.x) for t in fig.data)
    assert shown <= charts.MAX_SCATTER_POINTS
    assert f"showing {shown:,} of 12,000 requests" in fig.layout.title.text
    slowest = max(run.records, key=lambda r: r.ttft)
    assert any(slowest.request_id in t.text for t in fig.data)  # the outliers stay
    over = charts.latency_over_time(run)
    (depth,) = [t for t in over.data if t.name.startswith("queue depth")]
    assert len(depth.x) <= charts.MAX_LINE_POINTS and "max per" in depth.name
    assert "of 30,000 steps" in depth.name and max(depth.y) == 10
    gantt = charts.phase_timeline(run, [])
    bars = [t for t in gantt.data if t.name.startswith("engine step")]
    assert all(len(t.x) <= charts.MAX_STEP_BARS and "max per" in t.name for t in bars)
    assert max(bars[0].y) == 49 and max(bars[1].y) == 6


def test_small_runs_are_drawn_whole(runs):
    run = runs["stalls"]
    fig = charts.ttft_vs_input(run)
    assert sum(len(t.x) for t in fig.data) == sum(r.ttft is not None for r in run.records)
    assert fig.layout.title.text == "TTFT vs input length"
    over = charts.latency_over_time(run)
    (depth,) = [t for t in over.data if t.name.startswith("queue depth")]
    assert depth.name == "queue depth (waiting)" and len(depth.x) == len(run.steps)
