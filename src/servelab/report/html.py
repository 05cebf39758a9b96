"""The self-contained HTML report: plotly's JS is embedded once, inline, so the file
opens with no network. Sections per run: summary, findings and recommendations, TTFT
attribution, TTFT vs input length, ITL CDF, latency over time, throughput vs latency
across stages, the per-request phase timeline; with several runs, a comparison view
first. Every section carries ``data-section`` so tests and readers can find it.
"""

from __future__ import annotations

import datetime as _dt
import html
from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from servelab.analyze.compare import Comparison
from servelab.analyze.diagnosis.attribution import STALL_FACTOR
from servelab.analyze.diagnosis.diagnose import Diagnosis
from servelab.analyze.gaps import run_gaps
from servelab.analyze.summary import run_summary
from servelab.report import charts
from servelab.report.terminal import PART_LABELS
from servelab.report.windows import rates_text, window_label
from servelab.rundir import Run
from servelab.units import fmt_ms

# A curve through two points says nothing about its shape.
MIN_CURVE_POINTS = 3
RUN_SECTIONS = (
    "summary",
    "timeslices",
    "findings",
    "ttft-attribution",
    "ttft-vs-input",
    "lengths-sent",
    "itl-cdf",
    "over-time",
    "throughput-latency",
    "phase-timeline",
)

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#1f2d3d;color:#fff;padding:18px 32px}
header a{color:#9cf}
main{padding:8px 32px 48px}
section{background:#fff;border:1px solid #e3e3e3;border-radius:6px;margin:16px 0;padding:12px 18px}
section.run{background:#f4f6f8}
h1{margin:0 0 6px} h2{margin:6px 0 10px} h3{margin:4px 0 8px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:right;vertical-align:top}
th{background:#f0f0f0} td.l,th.l{text-align:left}
.ci{color:#888;font-size:11px} .note{color:#555;font-size:13px}
.better{color:#1a7f37;font-weight:600} .worse{color:#c62828;font-weight:600} .noise{color:#888}
.warn{background:#fff4e5;border-left:4px solid #f0a020;padding:6px 10px;margin:6px 0}
.finding{border-left:4px solid #f0a020;padding:6px 12px;margin:8px 0;background:#fffaf2}
.finding.high{border-color:#c62828} .finding.low{border-color:#bbb}
.ev{font-family:ui-monospace,monospace;font-size:12px;color:#444}
.chart{min-height:300px}
"""


def esc(x: Any) -> str:
    """``x`` as text safe inside HTML (the report's and the demo page's)."""
    return html.escape(str(x))


def figure_div(fig: go.Figure, modebar: bool = True) -> str:
    """A plotly figure as a chart div (plotly.js is loaded once per page). ``modebar=False``
    hides plotly's toolbar, for small charts where it would cover the title."""
    config = {"displaylogo": False, "responsive": True}
    if not modebar:
        config["displayModeBar"] = False
    return (
        '<div class="chart">'
        + fig.to_html(full_html=False, include_plotlyjs=False, config=config)
        + "</div>"
    )


def _section(key: str, prefix: str, title: str, body: str) -> str:
    return f'<section id="{prefix}{key}" data-section="{key}"><h3>{esc(title)}</h3>{body}</section>'


def _similarity_html(m: dict[str, Any]) -> str:
    """The prefix an ideal cache would reuse (client side) beside the server's hit rate."""

    def pct(v: Any) -> str:
        return "-" if v is None else f"{v:.1%}"

    groups = [("overall", m.get("overall", {}))] + list(m.get("by_class", {}).items())
    rows = "".join(
        f"<tr><td class='l'>{esc(name)}</td><td>{pct(g.get('prefix_reuse_ideal'))}</td>"
        f"<td>{pct(g.get('prefix_cache_hit_rate'))}</td></tr>"
        for name, g in groups
    )
    return (
        '<p class="note">Request similarity: the share of prompt tokens an ideal prefix cache '
        "would reuse (whole blocks, in send order, from the token ids sent) beside the share the "
        "server reported served from its cache (- where it reports none).</p>"
        "<table><tr><th class='l'>group</th><th>ideal prefix reuse</th>"
        f"<th>server cache hit rate</th></tr>{rows}</table>"
    )


def summary_table(metrics: dict[str, Any]) -> str:
    """Overall and per-class rows: every latency percentile with its CI, rates, goodput."""
    stats = ("p50", "p90", "p95", "p99", "mean", "max")
    head = "".join(f"<th>{m} {s}</th>" for m in ("ttft", "itl", "tpot", "e2e") for s in stats[:5])
    rows = []
    groups = [("overall", metrics["overall"])] + list(metrics.get("by_class", {}).items())
    groups += [(f"input {k}", v) for k, v in metrics.get("by_input_bucket", {}).items()]
    for label, g in groups:
        cells = [
            f'<td class="l">{esc(label)}</td>',
            f"<td>{g['requests']['ok']}/{g['requests']['sent']}</td>",
        ]
        for m in ("ttft", "itl", "tpot", "e2e"):
            lat = g["latency"][m]
            for s in stats[:5]:
                ci = lat.get("ci", {}).get(s)
                ci_txt = (
                    f'<br><span class="ci">[{fmt_ms(ci[0])}, {fmt_ms(ci[1])}]</span>' if ci else ""
                )
                cells.append(f"<td>{fmt_ms(lat.get(s))}{ci_txt}</td>")
        tput = g["throughput"]
        good = g["goodput"]
        cells += [
            f"<td>{_num(tput['requests_per_s'])}</td>",
            f"<td>{_num(tput['output_tokens_per_s'])}</td>",
            f"<td>{_num(good['requests_per_s'])}</td>",
            f"<td>{_pct(good['fraction'])}</td>",
        ]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return (
        '<p class="note">Latencies in ms with 95% bootstrap confidence intervals; rates per second '
        "over the measured window; goodput counts requests that met every SLO of their class.</p>"
        '<div style="overflow-x:auto"><table><tr><th class="l">group</th><th>ok/sent</th>'
        + head
        + "<th>req/s</th><th>out tok/s</th><th>goodput req/s</th><th>met SLO</th></tr>"
        + "".join(rows)
        + "</table></div>"
    )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def findings_html(d: Diagnosis) -> str:
    parts = [
        f'<p class="note">Attribution: <b>{esc(d.source)}</b>. '
        + " ".join(esc(n) for n in d.notes)
        + "</p>"
    ]
    if not d.findings:
        parts.append("<p>No findings: no cause is large enough to move a percentile.</p>")
    for f in d.findings:
        ev = ", ".join(f"{esc(k)}={esc(v)}" for k, v in f.evidence.items())
        parts.append(
            f'<div class="finding {f.confidence_label}"><b>{esc(f.title)}</b> '
            f"(confidence {f.confidence_label}, {f.confidence:.2f}; "
            f"{'exact' if f.exact else 'estimate'})<br>{esc(f.summary)}"
            f'<div class="ev">{ev}</div></div>'
        )
    recommended = [r for r in d.recommendations if r.recommended]
    if recommended:
        rows = "".join(
            f'<tr><td class="l"><b>{esc(r.title)}</b><br><span class="ci">for {esc(", ".join(r.because))}</span></td>'
            f'<td class="l">{esc(r.action)}</td><td class="l">{esc(r.expected_gain)}</td>'
            f'<td class="l">{esc(r.cost)}</td><td class="l">{esc(r.complexity)}</td>'
            f'<td class="l">{esc(r.not_worth_it_when)}</td></tr>'
            for r in recommended
        )
        parts.append(
            "<h3>Recommendations</h3><table><tr><th class='l'>lever</th><th class='l'>action</th>"
            "<th class='l'>expected gain</th><th class='l'>cost</th><th class='l'>complexity</th>"
            "<th class='l'>not worth it when</th></tr>" + rows + "</table>"
        )
    parts += [
        f'<p class="note">Considered, not recommended here: <b>{esc(r.title)}</b>: {esc(r.why_not)}</p>'
        for r in d.recommendations
        if not r.recommended
    ]
    if d.stalls_by_cause:
        rows = "".join(
            f"<tr><td class='l'>{esc(c)}</td><td>{int(v['count'])}</td><td>{v['excess_seconds']:.2f}</td></tr>"
            for c, v in sorted(d.stalls_by_cause.items(), key=lambda kv: -kv[1]["excess_seconds"])
        )
        parts.append(
            f"<h3>ITL stalls by cause</h3><p class='note'>Gaps of {STALL_FACTOR:g}x the "
            "request's median or more; a finding above may count only the longest ones.</p>"
            "<table><tr><th class='l'>cause</th><th>count</th>"
            "<th>time lost (s)</th></tr>" + rows + "</table>"
        )
    return "".join(parts)


def timeslices_html(summary: dict[str, Any]) -> str:
    """The steady-state verdict, offered vs achieved rate, and one row per time window."""
    ts = summary.get("timeslices")
    if not ts:
        return '<p class="note">This summary has no time windows (recorded before them).</p>'
    sat = ts["saturation"]
    rates = rates_text(ts, _num)
    if sat["state"] == "over_saturated":
        growth = sat["ttft_p50_trend"]["slope_per_minute"] * 1e3
        head = (
            f'<div class="warn">Over-saturated: {rates}; TTFT p50 grew {growth:,.0f} ms per '
            "minute. The queue grew through the run, so every percentile above depends on "
            "how long the run was (length-dependent), not only on the server.</div>"
        )
    elif sat["state"] == "steady":
        head = f"<p>Steady state: {rates} ({esc(sat['reason'])}).</p>"
    else:
        head = f"<p>Steady state: cannot tell. {esc(sat['reason'])}; {rates}.</p>"
    rows = "".join(
        f'<tr><td class="l">{window_label(w)} s</td><td>{w["sent"]}</td>'
        f"<td>{_num(w['offered_rate'])}</td><td>{_num(w['achieved_rate'])}</td>"
        f"<td>{_num(w['queue_depth'])}</td>"
        + "".join(f"<td>{fmt_ms(w[m][p])}</td>" for m, p in _WINDOW_COLS)
        + "</tr>"
        for w in ts["slices"]
    )
    cols = "".join(f"<th>{m.upper()} {p}</th>" for m, p in _WINDOW_COLS)
    return (
        head + f'<p class="note">Windows of {ts["slice_duration_s"]:g} s over the sending span; '
        f"queue depth: {esc(ts['depth_source'])} (time-weighted mean); latencies in ms of the "
        "requests sent in the window. docs/metrics.md gives the trend test.</p>"
        "<table><tr><th>window</th><th>sent</th><th>offered/s</th><th>achieved/s</th>"
        f"<th>queue</th>{cols}</tr>{rows}</table>"
    )


_WINDOW_COLS = (("ttft", "p50"), ("ttft", "p99"), ("itl", "p99"), ("e2e", "p50"))


def server_said(server: dict[str, Any]) -> str:
    """What a server without a resolved engine config said about itself when probed: its
    /version, /v1/models' max_model_len and the labels of its /metrics info gauges."""
    said = []
    version = server.get("version")
    if isinstance(version, dict) and isinstance(version.get("version"), str):
        said.append(f"version={version['version']}")
    if server.get("max_model_len") is not None:
        said.append(f"max_model_len={server['max_model_len']}")
    for name, labels in (server.get("info_metrics") or {}).items():
        kept = ", ".join(f"{k}={v}" for k, v in labels.items() if v not in ("", "None"))
        said.append(f"{name}: {kept}")
    return "; ".join(said)


def _run_header(run: Run) -> str:
    cfg = (
        ", ".join(f"{k}={v}" for k, v in run.engine_config.items())
        or server_said(run.server)
        or "unknown"
    )
    wl = run.workload
    wl_txt = wl.get("name") if isinstance(wl, dict) and wl.get("name") else wl
    t0, t1 = run.window
    lines = [
        f"<b>model</b> {esc(run.model)} &nbsp; <b>target</b> {esc(run.target_kind)}"
        + (" (simulated)" if run.simulated else ""),
        f"<b>server config</b> {esc(cfg)}",
        f"<b>workload</b> {esc(wl_txt)} &nbsp; <b>requests</b> {len(run.records)} &nbsp; "
        + f"<b>window</b> {t1 - t0:.1f} s",
    ]
    warn = (
        ""
        if run.valid
        else f'<div class="warn">This run is marked invalid: {esc(run.invalid_reason)}</div>'
    )
    return warn + "<p>" + "<br>".join(lines) + "</p>"


def run_sections(run: Run, d: Diagnosis, prefix: str) -> str:
    stalls = d.attribution.stalls if d.attribution else []
    pts = charts.stage_points(run)
    sweep = (
        figure_div(charts.throughput_vs_latency({run.name: pts}))
        if len(pts) >= MIN_CURVE_POINTS
        else f'<p class="note">Fewer than {MIN_CURVE_POINTS} load levels: no sweep stages to plot. Run '
        "<code>servelab bench</code> with several rates to see the throughput-latency curve; "
        "with several runs, the comparison view above plots one point per run.</p>"
    )
    body = [
        _run_header(run),
        _section("summary", prefix, "Summary", summary_table(run_summary(run))),
        _section(
            "timeslices",
            prefix,
            "Steady state: time windows",
            timeslices_html(run_summary(run)),
        ),
        _section("findings", prefix, "Findings and recommendations", findings_html(d)),
        _section(
            "ttft-attribution",
            prefix,
            "Where TTFT went",
            (
                figure_div(charts.ttft_attribution(d))
                if d.overall
                else "<p>No successful requests.</p>"
            )
            + _parts_legend(),
        ),
        _section(
            "ttft-vs-input", prefix, "TTFT vs input length", figure_div(charts.ttft_vs_input(run))
        ),
        _section(
            "lengths-sent",
            prefix,
            "What was sent: lengths and request similarity",
            _similarity_html(run_summary(run)) + figure_div(charts.lengths_sent(run)),
        ),
        _section("itl-cdf", prefix, "ITL distribution", figure_div(charts.itl_cdf(run))),
        _section(
            "over-time", prefix, "Latency over time", figure_div(charts.latency_over_time(run))
        ),
        _section("throughput-latency", prefix, "Throughput vs latency", sweep),
        _section(
            "phase-timeline",
            prefix,
            "The two phases, request by request",
            '<p class="note">Each row is one request (the slowest TTFTs, those with stalls, and '
            "a random rest): grey queued, orange prefill chunks, blue decoding, red stalls as "
            "the client saw them. Beneath, what each engine step computed.</p>"
            + figure_div(charts.phase_timeline(run, stalls)),
        ),
    ]
    return "".join(body)


def _parts_legend() -> str:
    return (
        '<p class="note">'
        + "; ".join(f"<b>{esc(k)}</b>: {esc(v)}" for k, v in PART_LABELS.items())
        + ".</p>"
    )


def comparison_html(
    c: Comparison, groups: list[list[Run]], keep: set[tuple[str, str, str]] | None = None
) -> str:
    """The comparison view: warnings, charts over the compared groups, the full table.

    With ``keep`` ((scope, metric, stat) rows a question names), the table shows those and
    the significant rows; the rest fold away in a collapsed ``<details>``."""
    warn = "".join(f'<div class="warn">{esc(w)}</div>' for w in c.warnings)
    head = (
        "<tr><th class='l'>scope</th><th class='l'>metric</th>"
        + "".join(
            f"<th>{esc(label)}</th>" + ("<th>delta</th><th>p</th><th>verdict</th>" if i else "")
            for i, label in enumerate(c.labels)
        )
        + "</tr>"
    )
    rows: list[str] = []
    folded: list[str] = []
    for r in c.rows:
        shown = keep is None or (r.scope, r.metric, r.stat) in keep or any(r.significant[1:])
        unit = "" if "." in r.metric else " (ms)"
        cells = [
            f"<td class='l'>{esc(r.scope)}</td>",
            f"<td class='l'>{esc(r.metric)} {esc(r.stat if r.stat != 'value' else '')}{unit}</td>",
        ]
        for i in range(len(c.labels)):
            v = r.values[i]
            cells.append(
                f"<td>{'-' if v is None else (f'{v:.2f}' if '.' in r.metric else fmt_ms(v))}</td>"
            )
            if i:
                verdict = r.verdict(i)
                d = r.delta[i]
                cells += [
                    f"<td>{'-' if d is None else f'{d:+.1%}'}</td>",
                    f"<td>{'-' if r.p[i] is None else f'{r.p[i]:.3f}'}</td>",
                    f"<td class='{verdict}'>{verdict or '-'}</td>",
                ]
        (rows if shown else folded).append("<tr>" + "".join(cells) + "</tr>")
    notes = "".join(f'<p class="note">{esc(n)}</p>' for n in c.notes)
    recs = [[r for run in g for r in run.records if r.ok] for g in groups]
    ttft = {lab: [r.ttft for r in g if r.ttft is not None] for lab, g in zip(c.labels, recs)}
    itl = {lab: _ok_gaps(g) for lab, g in zip(c.labels, groups)}
    return (
        warn
        + notes
        + figure_div(charts.percentile_bars(c))
        + figure_div(charts.cdf(ttft, "TTFT distribution per run (CDF)", "TTFT (ms, log)", "run"))
        + figure_div(
            charts.cdf(
                itl, "ITL distribution per run (CDF)", "inter-token latency (ms, log)", "run"
            )
        )
        + (
            figure_div(charts.throughput_vs_latency({"runs": points}, connect=False))
            if len(points := charts.comparison_points(c)) >= MIN_CURVE_POINTS
            else ""
        )
        + '<div style="overflow-x:auto"><table>'
        + head
        + "".join(rows)
        + "</table></div>"
        + (
            f"<details><summary>{len(folded)} more rows, none significant</summary>"
            f'<div style="overflow-x:auto"><table>{head}{"".join(folded)}</table></div></details>'
            if folded
            else ""
        )
    )


def _ok_gaps(runs: list[Run]) -> np.ndarray:
    """The ITL gaps of the successful requests of ``runs``, run after run."""
    parts = []
    for run in runs:
        gaps = run_gaps(run)
        parts.append(gaps.values[gaps.mask(np.array([r.ok for r in run.records], bool))])
    return np.concatenate(parts) if parts else np.zeros(0)


def build_report(
    runs: list[Run],
    diagnoses: list[Diagnosis],
    comparison: Comparison | None = None,
    title: str | None = None,
    groups: list[list[Run]] | None = None,
) -> str:
    """The whole HTML document as a string. ``groups`` are the runs behind each of the
    comparison's columns (default: one run per column, in order)."""
    names = ", ".join(r.name for r in runs)
    title = title or f"servelab report: {names}"
    nav = []
    body = []
    if comparison is not None:
        nav.append('<a href="#comparison">comparison</a>')
        body.append(
            '<section id="comparison" data-section="comparison"><h2>Comparison (first run is the '
            "baseline)</h2>"
            + comparison_html(comparison, groups or [[r] for r in runs])
            + "</section>"
        )
    for i, (run, d) in enumerate(zip(runs, diagnoses)):
        prefix = f"r{i}-"
        nav.append(f'<a href="#{prefix}run">{esc(run.name)}</a>')
        body.append(
            f'<section class="run" id="{prefix}run" data-run="{esc(run.name)}"><h2>{esc(run.name)}</h2>'
            + run_sections(run, d, prefix)
            + "</section>"
        )
    now = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{esc(title)}</title><style>{CSS}</style>"
        f"<script>{get_plotlyjs()}</script></head><body>"
        f"<header><h1>{esc(title)}</h1><div>generated {now} by servelab · "
        "how to read it: docs/reading-the-report.md · " + " · ".join(nav) + "</div></header>"
        "<main>" + "".join(body) + "</main></body></html>"
    )


def write_report(
    runs: list[Run],
    diagnoses: list[Diagnosis],
    out: Path,
    comparison: Comparison | None = None,
    title: str | None = None,
    groups: list[list[Run]] | None = None,
) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(build_report(runs, diagnoses, comparison, title, groups), encoding="utf-8")
    return out
