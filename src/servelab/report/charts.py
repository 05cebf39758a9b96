"""Plotly figures of the report. Each takes analysed data and returns a Figure with a
title, axes with units and a legend; none computes a metric of its own beyond binning
for display."""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from servelab.analyze.compare import Comparison
from servelab.analyze.diagnosis.attribution import TTFT_PARTS, Stall
from servelab.analyze.diagnosis.diagnose import Diagnosis, PartsTable
from servelab.analyze.gaps import run_gaps
from servelab.analyze.summary import stage_summaries
from servelab.rundir import Run
from servelab.vocab import ClientRecord, RequestTimeline

PALETTE = qualitative.D3
PHASE_COLORS = {
    "queue": "#bdbdbd",
    "prefill": "#ff7f0e",
    "decode": "#1f77b4",
    "stall": "#d62728",
    "preempted": "#9467bd",
    "network": "#7f7f7f",
    "unsplit": "#dadaeb",
}
PART_COLORS = dict(
    zip(
        TTFT_PARTS,
        ["#8c564b", "#c49c94", "#c7c7c7", "#7f7f7f", "#bdbdbd", "#ff7f0e", "#e377c2", "#9467bd"]
        + ["#17becf"],
    )
)
UNSPLIT = "not split: server + network (client view only)"
UNSPLIT_MIN_SHARE = 0.01  # below this the parts are taken to cover TTFT (rounding, clock skew)
MAX_CDF_POINTS = 1500
GANTT_SAMPLE = 24
# Above these, a chart draws a sample or per-bin aggregates (and says so): a browser
# cannot show more than a few thousand markers or bars on a chart a screen wide.
MAX_SCATTER_POINTS = 5000
SCATTER_SLOWEST = 50  # the slowest requests a thinned scatter always keeps
MAX_LINE_POINTS = 20_000
MAX_STEP_BARS = 20_000


def _layout(fig: go.Figure, title: str, height: int = 440, **kw: Any) -> go.Figure:
    fig.update_layout(
        title=title,
        height=height,
        template="plotly_white",
        legend={"title": kw.pop("legend_title", None)},
        margin={"l": 70, "r": 30, "t": 60, "b": 50},
        showlegend=True,
        **kw,
    )
    return fig


def class_colors(classes: list[str]) -> dict[str, str]:
    return {c: PALETTE[i % len(PALETTE)] for i, c in enumerate(sorted(classes))}


def _evenly(n: int, k: int) -> np.ndarray:
    """``k`` of ``range(n)``, evenly spaced, first and last included."""
    return np.unique(np.linspace(0, n - 1, k).round().astype(np.int64))


def ttft_vs_input(run: Run) -> go.Figure:
    """One marker per request; above ``MAX_SCATTER_POINTS`` requests, those evenly spaced
    in send order and the ``SCATTER_SLOWEST`` slowest, as the title says."""
    fig = go.Figure()
    colors = class_colors(run.classes)
    recs = [r for r in run.records if r.ttft is not None]
    title = "TTFT vs input length"
    if len(recs) > MAX_SCATTER_POINTS:
        ttft = np.array([r.ttft for r in recs])
        slowest = np.argsort(-ttft, kind="stable")[:SCATTER_SLOWEST]
        order = np.argsort([r.actual_send for r in recs], kind="stable")
        even = order[_evenly(len(recs), MAX_SCATTER_POINTS - SCATTER_SLOWEST)]
        keep = np.union1d(even, slowest)
        title += (
            f" (showing {len(keep):,} of {len(recs):,} requests: evenly spaced in send "
            f"order, and the {SCATTER_SLOWEST} slowest)"
        )
        recs = [recs[i] for i in keep.tolist()]
    for cls in run.classes:
        mine = [r for r in recs if r.workload_class == cls]
        ttfts = [r.ttft for r in mine if r.ttft is not None]
        fig.add_trace(
            go.Scatter(
                x=[r.input_tokens for r in mine],
                y=[t * 1e3 for t in ttfts],
                mode="markers",
                name=cls,
                marker={"color": colors[cls], "size": 6, "opacity": 0.7},
                text=[r.request_id for r in mine],
                hovertemplate="%{text}<br>%{x} input tokens<br>TTFT %{y:.1f} ms<extra></extra>",
            )
        )
    return _layout(
        fig,
        title,
        xaxis_title="input length (tokens)",
        yaxis_title="TTFT (ms)",
        legend_title="workload class",
    )


def lengths_sent(run: Run) -> go.Figure:
    """Histograms of the input and output lengths the run actually sent, per class."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("input tokens", "output tokens"))
    colors = class_colors(run.classes)
    for cls in run.classes:
        recs = [r for r in run.records if r.workload_class == cls]
        for col, values in (
            (1, [r.input_tokens for r in recs]),
            (2, [r.output_tokens for r in recs if r.output_tokens]),
        ):
            fig.add_trace(
                go.Histogram(
                    x=values,
                    name=cls,
                    legendgroup=cls,
                    showlegend=col == 1,
                    marker={"color": colors[cls]},
                    opacity=0.7,
                    nbinsx=30,
                ),
                row=1,
                col=col,
            )
    fig.update_layout(barmode="overlay")
    return _layout(fig, "Lengths sent", legend_title="workload class", yaxis_title="requests")


def _ecdf(values: Sequence[float] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    v = np.sort(np.asarray(values))
    y = np.arange(1, len(v) + 1) / len(v)
    if len(v) > MAX_CDF_POINTS:
        keep = np.unique(np.linspace(0, len(v) - 1, MAX_CDF_POINTS).astype(int))
        v, y = v[keep], y[keep]
    return v, y


def cdf(
    series: Mapping[str, Sequence[float] | np.ndarray], title: str, x_title: str, legend: str
) -> go.Figure:
    """Empirical CDFs (values in seconds, drawn in ms), one line per series."""
    fig = go.Figure()
    for i, (name, vals) in enumerate(series.items()):
        if not len(vals):
            continue
        x, y = _ecdf(vals)
        fig.add_trace(
            go.Scatter(
                x=x * 1e3,
                y=y,
                mode="lines",
                name=name,
                line={"color": PALETTE[i % len(PALETTE)], "shape": "hv"},
            )
        )
    fig.update_xaxes(type="log")
    return _layout(
        fig, title, xaxis_title=x_title, yaxis_title="fraction of values ≤ x", legend_title=legend
    )


def itl_cdf(run: Run) -> go.Figure:
    gaps = run_gaps(run)
    series = {
        cls: gaps.values[
            gaps.mask(np.array([r.ok and r.workload_class == cls for r in run.records], bool))
        ]
        for cls in run.classes
    }
    return cdf(series, "ITL distribution per class (CDF)", "inter-token latency (ms, log)", "class")


def _bins(t0: float, t1: float, n: int = 40) -> np.ndarray:
    return np.linspace(t0, t1, n + 1) if t1 > t0 else np.array([t0, t0 + 1.0])


def _binned_percentile(
    t: np.ndarray, v: np.ndarray, edges: np.ndarray, q: float
) -> list[float | None]:
    """Per bin [edges[k], edges[k + 1]): the q-th percentile of the values whose time falls
    in it, in ms (None for an empty bin). Each time is binned once (a small integer each:
    a long run has tens of millions of gaps)."""
    k = (np.searchsorted(edges, t, "right") - 1).astype(np.min_scalar_type(-len(edges)))
    out: list[float | None] = []
    for i in range(len(edges) - 1):
        sel = v[k == i]
        out.append(float(np.percentile(sel, q, overwrite_input=True)) * 1e3 if sel.size else None)
    return out


def _step_line(
    t: np.ndarray, v: np.ndarray, limit: int = MAX_LINE_POINTS
) -> tuple[np.ndarray, np.ndarray, float | None]:
    """A step series as drawn: itself up to ``limit`` points, else the maximum of each of
    ``limit`` equal time bins (at the bin's start), and the bin width."""
    if len(t) <= limit:
        return t, v, None
    edges = np.linspace(t.min(), max(t.max(), t.min() + 1e-9), limit + 1)
    k = np.clip(np.searchsorted(edges, t, "right") - 1, 0, limit - 1)
    peak = np.full(limit, -np.inf)
    np.maximum.at(peak, k, v)
    has = np.isfinite(peak)
    return edges[:-1][has], peak[has], float(edges[1] - edges[0])


def latency_over_time(run: Run) -> go.Figure:
    """Rolling TTFT/ITL percentiles per time bin, with in-flight requests and queue depth."""
    t0, t1 = run.window
    edges = _bins(t0, t1)
    mids = (edges[:-1] + edges[1:]) / 2 - t0
    ok = [r for r in run.records if r.ok and r.ttft is not None]
    sends = np.array([r.actual_send for r in ok])
    ttft = np.array([r.ttft for r in ok])
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for q, dash in ((50, "solid"), (95, "dash")):
        fig.add_trace(
            go.Scatter(
                x=mids,
                y=_binned_percentile(sends, ttft, edges, q),
                name=f"TTFT p{q} (ms)",
                line={"dash": dash, "color": "#ff7f0e"},
                connectgaps=False,
            ),
            secondary_y=False,
        )
    gaps = run_gaps(run)
    mask = gaps.mask(np.array([r.ok and r.ttft is not None for r in run.records], bool))
    if mask.any():
        arrivals = np.fromiter(
            itertools.chain.from_iterable(r.chunk_times[1:] for r in ok), np.float64
        )  # of the chunk that closed each gap
        fig.add_trace(
            go.Scatter(
                x=mids,
                y=_binned_percentile(arrivals, gaps.values[mask], edges, 99),
                name="ITL p99 (ms)",
                line={"color": "#1f77b4"},
            ),
            secondary_y=False,
        )
    # in flight at t: sent at or before t, done (or sent) at or after it
    starts = np.array([r.actual_send for r in run.records])
    ends = np.array([(r.done or r.actual_send) for r in run.records])
    valid = ends >= starts
    starts, ends = np.sort(starts[valid]), np.sort(ends[valid])
    at = mids + t0
    inflight = (np.searchsorted(starts, at, "right") - np.searchsorted(ends, at, "left")).tolist()
    fig.add_trace(
        go.Scatter(
            x=mids,
            y=inflight,
            name="in-flight requests",
            line={"color": "#2ca02c"},
            fill="tozeroy",
            opacity=0.3,
        ),
        secondary_y=True,
    )
    if run.steps:
        xs, ys, width = _step_line(
            np.array([s.start - t0 for s in run.steps]),
            np.array([s.num_waiting for s in run.steps]),
        )
        name = "queue depth (waiting)"
        if width is not None:
            name += f" (max per {width:.3g} s of {len(run.steps):,} steps)"
        fig.add_trace(
            go.Scatter(
                x=xs.tolist(),
                y=ys.tolist(),
                name=name,
                line={"color": "#7f7f7f", "shape": "hv"},
            ),
            secondary_y=True,
        )
    fig.update_yaxes(title_text="latency (ms)", secondary_y=False)
    fig.update_yaxes(title_text="requests", secondary_y=True, rangemode="tozero", showgrid=False)
    fig.update_yaxes(rangemode="tozero", secondary_y=False)
    return _layout(
        fig,
        "Latency percentiles over time, with load",
        xaxis_title="time since start (s)",
        legend_title="series",
    )


def stage_points(run: Run) -> list[dict[str, Any]]:
    """Per sweep stage: output tokens/s and latency percentiles."""
    return [summary_point(label, m) for label, m in stage_summaries(run).items()]


def summary_point(label: str, m: dict[str, Any]) -> dict[str, Any]:
    """One point of the throughput-latency chart from a ``summarize`` body."""
    o = m["overall"]
    return {
        "stage": label,
        "throughput": o["throughput"]["output_tokens_per_s"],
        "ttft_p50": o["latency"]["ttft"]["p50"],
        "ttft_p99": o["latency"]["ttft"]["p99"],
        "itl_p99": o["latency"]["itl"]["p99"],
    }


def throughput_vs_latency(
    points: dict[str, list[dict[str, Any]]], connect: bool = True
) -> go.Figure:
    """Output tokens/s against latency: per label, a line through its load stages
    (``connect``), or separate points when each point is a different run."""
    fig = go.Figure()
    for i, (label, pts) in enumerate(points.items()):
        color = PALETTE[i % len(PALETTE)]
        for key, dash in (("ttft_p50", "solid"), ("ttft_p99", "dash"), ("itl_p99", "dot")):
            fig.add_trace(
                go.Scatter(
                    x=[p["throughput"] for p in pts],
                    y=[(p[key] or 0.0) * 1e3 for p in pts],
                    mode="lines+markers+text" if connect else "markers+text",
                    text=[p["stage"] for p in pts],
                    textposition="top center",
                    name=f"{label}: {key.replace('_', ' ')}",
                    line={"color": color, "dash": dash},
                )
            )
    return _layout(
        fig,
        "Throughput vs latency " + ("across load stages" if connect else "per run"),
        xaxis_title="output throughput (tokens/s)",
        yaxis_title="latency (ms)",
        legend_title="run: metric",
    )


def ttft_attribution(d: Diagnosis) -> go.Figure:
    """Stacked bars: mean ms per TTFT part, overall, slowest 10% and per class.

    Whatever of a row's TTFT its parts do not cover is drawn as "not split": a run against
    another server may split only the overall row (from /metrics means), and its other rows
    would otherwise be empty.
    """
    named = {"all requests": d.overall, "slowest 10%": d.tail} | {
        f"class {k}": v for k, v in d.by_class.items()
    }
    tables = {k: v for k, v in named.items() if v is not None}
    fig = go.Figure()
    parts = list(next(iter(tables.values())).parts) if tables else []
    for part in parts:
        fig.add_trace(
            go.Bar(
                y=list(tables),
                x=[t.parts.get(part, 0.0) * 1e3 for t in tables.values()],
                name=f"{part} ({d.part_sources.get(part, '')})",
                orientation="h",
                marker={"color": PART_COLORS.get(part)},
            )
        )
    rest = {k: unsplit_ttft(t) for k, t in tables.items()}
    if any(v > 0 for v in rest.values()):
        fig.add_trace(
            go.Bar(
                y=list(rest),
                x=[v * 1e3 for v in rest.values()],
                name=UNSPLIT,
                orientation="h",
                marker={"color": PHASE_COLORS["unsplit"], "pattern": {"shape": "/"}},
            )
        )
    fig.update_layout(barmode="stack")
    fig.update_yaxes(autorange="reversed")
    return _layout(
        fig,
        "Where TTFT went (mean per request)",
        height=140 + 60 * max(len(tables), 1),
        xaxis_title="time (ms)",
        yaxis_title="requests",
        legend_title="part (how obtained)",
    )


def unsplit_ttft(t: PartsTable) -> float:
    """Mean seconds of TTFT from the intended send that no part covers (0 when covered)."""
    whole = t.ttft_mean + t.parts.get("client_lag", 0.0)
    rest = whole - sum(t.parts.values())
    return rest if whole > 0 and rest > UNSPLIT_MIN_SHARE * whole else 0.0


def _sample(run: Run, stalls: list[Stall], n: int = GANTT_SAMPLE) -> list[ClientRecord]:
    """The slowest TTFTs, requests with stalls, and a seeded random rest."""
    ok = [r for r in run.records if r.ok and r.chunk_times]
    picked: dict[str, ClientRecord] = {}
    by_id = {r.request_id: r for r in ok}
    for r in sorted(ok, key=lambda r: -(r.ttft or 0.0))[: n // 3]:
        picked[r.request_id] = r
    for s in sorted(stalls, key=lambda s: -s.excess):
        if len(picked) >= 2 * n // 3:
            break
        if s.request_id in by_id:
            picked[s.request_id] = by_id[s.request_id]
    rest = [r for r in ok if r.request_id not in picked]
    random.Random(0).shuffle(rest)
    for r in rest[: n - len(picked)]:
        picked[r.request_id] = r
    return sorted(picked.values(), key=lambda r: r.actual_send)


def _segments(pairs: list[tuple[float, float, str]]) -> tuple[list, list]:
    xs: list[float | None] = []
    ys: list[str | None] = []
    for a, b, y in pairs:
        xs += [a, b, None]
        ys += [y, y, None]
    return xs, ys


def phase_timeline(run: Run, stalls: list[Stall]) -> go.Figure:
    """Gantt of a sample of requests (queue, prefill chunks, decode, stalls), engine steps beneath."""
    sample = _sample(run, stalls)
    t0 = run.window[0]
    rows = 3 if run.steps else 1
    fig = make_subplots(
        rows=rows,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.04,
        row_heights=[0.7, 0.15, 0.15][:rows] if rows == 3 else [1.0],
    )
    spans: dict[str, list[tuple[float, float, str]]] = {k: [] for k in PHASE_NAMES}
    stall_by_req: dict[str, list[Stall]] = {}
    for s in stalls:
        stall_by_req.setdefault(s.request_id, []).append(s)
    for rec in sample:
        label = f"{rec.request_id} ({rec.workload_class}, {rec.input_tokens} in)"
        tl = run.timeline_for(rec)
        if tl is not None and tl.scheduled:
            _timeline_spans(tl, label, t0, spans)
        else:
            _client_spans(rec, label, t0, spans)
        for s in stall_by_req.get(rec.request_id, []):
            spans["stall"].append((s.at - t0, s.at + s.gap - t0, label))
    for kind, pairs in spans.items():
        if not pairs:
            continue
        xs, ys = _segments(pairs)
        base = kind.removesuffix(REPORTED)
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                mode="lines",
                name=PHASE_NAMES[kind],
                line={
                    "color": PHASE_COLORS[base],
                    "width": 9 if kind != "stall" else 4,
                    "dash": "dot" if kind in ESTIMATED_PHASES else "solid",
                },
            ),
            row=1,
            col=1,
        )
    if run.steps:
        lo = min(rec.actual_send for rec in sample) - t0 if sample else 0.0
        hi = max((rec.done or rec.actual_send) for rec in sample) - t0 if sample else 0.0
        steps = [s for s in run.steps if lo <= s.start - t0 <= hi]
        mids = [(s.start + s.end) / 2 - t0 for s in steps]
        widths = [s.duration for s in steps]
        lanes = [
            ("prefill", "prefill tokens", "prefill<br>tokens", [s.prefill_tokens for s in steps]),
            ("decode", "decode sequences", "decode<br>seqs", [s.decode_seqs for s in steps]),
        ]
        binned = ""
        if len(steps) > MAX_STEP_BARS:
            mids, widths, lanes = _step_bins(mids, lanes)
            binned = f" (max per {widths[0]:.3g} s of {len(steps):,} steps)"
        for row, (phase, what, axis, ys) in enumerate(lanes, start=2):
            fig.add_trace(
                go.Bar(
                    x=mids,
                    y=ys,
                    width=widths,
                    name=f"engine step: {what}{binned}",
                    marker={"color": PHASE_COLORS[phase]},
                ),
                row=row,
                col=1,
            )
            fig.update_yaxes(title_text=axis, row=row, col=1)
    fig.update_yaxes(autorange="reversed", row=1, col=1, title_text="request")
    fig.update_xaxes(title_text="time since start (s)", row=rows, col=1)
    return _layout(
        fig,
        "Per-request phase timeline (sample) with the engine steps beneath",
        height=260 + 26 * len(sample) + (240 if run.steps else 0),
        legend_title="phase",
        bargap=0,
    )


def _step_bins(
    mids: list[float], lanes: list[tuple[str, str, str, list[int]]], n: int = MAX_STEP_BARS
) -> tuple[list[float], list[float], list[tuple[str, str, str, list[int]]]]:
    """Steps too many to draw one bar each, as ``n`` equal time bins holding each lane's
    largest value (a bar per bin, as wide as the bin)."""
    t = np.asarray(mids)
    edges = np.linspace(t.min(), max(t.max(), t.min() + 1e-9), n + 1)
    k = np.clip(np.searchsorted(edges, t, "right") - 1, 0, n - 1)
    has = np.bincount(k, minlength=n) > 0
    out = []
    for phase, what, axis, ys in lanes:
        peak = np.zeros(n, np.int64)
        np.maximum.at(peak, k, np.asarray(ys, np.int64))
        out.append((phase, what, axis, peak[has].tolist()))
    width = float(edges[1] - edges[0])
    centres = ((edges[:-1] + edges[1:]) / 2)[has].tolist()
    return centres, [width] * len(centres), out


# Phase rows of the timeline. Another server's phases come from its per-request figures
# (durations it measured, placed back from the first token the client saw: "reported"), or,
# without them, from the client alone (the wait for the first token is not split).
REPORTED = "_reported"
PHASE_NAMES = {
    "queue": "queued (waiting for admission)",
    "prefill": "prefill chunk",
    "decode": "decoding",
    "stall": "ITL stall (client view)",
    "preempted": "preempted (re-queued)",
    "network": "send to server queue (estimated: network, HTTP, tokenising)",
    "queue" + REPORTED: "queued (server's figure, placed from the first token)",
    "prefill" + REPORTED: "prefill (server's figure, placed from the first token)",
    "unsplit": "waiting for the first token (queue + prefill, not split: client view)",
}
ESTIMATED_PHASES = {"network", "queue" + REPORTED, "prefill" + REPORTED, "unsplit"}


def _client_spans(
    rec: ClientRecord, label: str, t0: float, spans: dict[str, list[tuple[float, float, str]]]
) -> None:
    """A request of another server: its reported queue and prefill, or one unsplit wait."""
    first, send = rec.chunk_times[0], rec.actual_send
    s = rec.server_timeline or {}
    prefill = s.get("prefill_time") if "reported_by" in s else None
    if prefill is not None:
        scheduled = max(send, first - prefill)
        queued = max(send, scheduled - (s.get("queue_time") or 0.0))
        if "queue_time" in s:
            spans["network"].append((send - t0, queued - t0, label))
            spans["queue" + REPORTED].append((queued - t0, scheduled - t0, label))
        else:  # no queue figure (llama.cpp): queueing stays inside the wait before prefill
            spans["unsplit"].append((send - t0, scheduled - t0, label))
        spans["prefill" + REPORTED].append((scheduled - t0, first - t0, label))
    else:
        spans["unsplit"].append((send - t0, first - t0, label))
    spans["decode"].append((first - t0, rec.chunk_times[-1] - t0, label))


def _timeline_spans(
    tl: RequestTimeline, label: str, t0: float, spans: dict[str, list[tuple[float, float, str]]]
) -> None:
    for k, adm in enumerate(tl.scheduled):
        entered = tl.queued[k] if k < len(tl.queued) else adm
        spans["queue" if k == 0 else "preempted"].append((entered - t0, adm - t0, label))
    for c in tl.chunks:
        spans["prefill"].append((c.start - t0, c.end - t0, label))
    if tl.first_token is not None and tl.finished is not None:
        spans["decode"].append((tl.first_token - t0, tl.finished - t0, label))


def percentile_bars(c: Comparison) -> go.Figure:
    """Overall p50 and p99 of each latency metric, one bar group per compared run."""
    fig = go.Figure()
    keys = ("ttft", "itl", "tpot", "e2e")
    for i, label in enumerate(c.labels):
        for q, pattern in (("p50", ""), ("p99", "/")):
            fig.add_trace(
                go.Bar(
                    x=[f"{k} {q}" for k in keys],
                    y=[(c.row(k, q).values[i] or 0.0) * 1e3 for k in keys],
                    name=f"{label} {q}",
                    marker={"color": PALETTE[i % len(PALETTE)], "pattern": {"shape": pattern}},
                )
            )
    fig.update_yaxes(type="log")
    return _layout(
        fig,
        "Latency percentiles per run",
        xaxis_title="metric and percentile",
        yaxis_title="latency (ms, log)",
        legend_title="run",
        barmode="group",
    )


def comparison_points(c: Comparison) -> list[dict[str, Any]]:
    """One throughput-latency point per compared run (or group of repeats)."""
    return [
        {
            "stage": label,
            "throughput": c.row("throughput.output_tokens_per_s", "value").values[i],
            "ttft_p50": c.row("ttft", "p50").values[i],
            "ttft_p99": c.row("ttft", "p99").values[i],
            "itl_p99": c.row("itl", "p99").values[i],
        }
        for i, label in enumerate(c.labels)
    ]
