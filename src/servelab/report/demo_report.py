"""The demo's HTML report: it opens with the answers (one sentence each, and a chart of
where the time went: the key figure's parts, stacked, for each configuration compared),
then folds the full comparisons and one run's sections per question into collapsed
``<details>``.
"""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from servelab.analyze.answers import Answer
from servelab.analyze.compare import Comparison
from servelab.analyze.diagnosis import timesplit
from servelab.analyze.diagnosis.diagnose import Diagnosis
from servelab.analyze.diagnosis.timesplit import TimeSplit
from servelab.report.html import CSS, comparison_html, esc, figure_div, run_sections
from servelab.rundir import Run

_VERDICT_CSS = {"significant": "better", "noise": "noise"}


# Parts in a fixed colour each, so a part reads the same on every card.
_PART_COLOURS = {
    "queue": "#d62728",
    "prefill": "#1f77b4",
    "interference": "#ff7f0e",
    "preemption": "#8c564b",
    "overhead": "#9467bd",
    "network_http": "#7f7f7f",
    "client_lag": "#bcbd22",
    "stall: prefill": "#ff7f0e",
    "stall: client": "#bcbd22",
    "stall: server": "#aec7e8",
    "stall: batch_growth": "#9467bd",
    "stall: preemption": "#8c564b",
    "stall: unknown": "#c7c7c7",
    timesplit.TYPICAL_GAP: "#2ca02c",
    timesplit.BELOW_THRESHOLD: "#17becf",
    timesplit.STEP_ONE: "#2ca02c",
    timesplit.STEP_ADDED: "#17becf",
    timesplit.PLAIN_STEPS: "#2ca02c",
    timesplit.SPEC_STEPS: "#e377c2",
    timesplit.BETWEEN_STEPS: "#17becf",
}
_OTHER_COLOURS = ["#98df8a", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d"]


def split_chart(split: TimeSplit) -> go.Figure:
    """Where the time went: one horizontal bar per configuration (baseline on top), its
    parts stacked in ms; the bar's total is the figure the split adds up to."""
    labels = [label for label, _ in split.bars]
    fig = go.Figure()
    others = iter(_OTHER_COLOURS)
    for part in split.parts:
        colour = _PART_COLOURS.get(part) or next(others, "#c7c7c7")
        fig.add_trace(
            go.Bar(
                y=labels,
                x=[parts.get(part, 0.0) * 1e3 for _, parts in split.bars],
                name=part,
                orientation="h",
                marker_color=colour,
                hovertemplate=f"{part}: %{{x:.0f}} ms<extra></extra>",
            )
        )
    rows = _legend_rows(split.parts)
    fig.update_layout(
        barmode="stack",
        height=80 + 34 * len(labels) + _LEGEND_ROW_PX * rows,
        margin={"l": 10, "r": 10, "t": 28, "b": 24 + _LEGEND_ROW_PX * rows},
        title={"text": f"{split.title} (ms)", "font": {"size": 12}},
        template="plotly_white",
        yaxis={"autorange": "reversed", "automargin": True},
        # Anchored to the figure's bottom edge, not the plot's: below the axis however few
        # bars there are.
        legend={"orientation": "h", "font": {"size": 10}, "yref": "container", "y": 0,
                "yanchor": "bottom"},
    )  # fmt: skip
    return fig


_LEGEND_ROW_PX = 20
_CARD_PX = 480  # a card's chart width at the report's usual width (two cards a row)


def _legend_rows(parts: list[str]) -> int:
    """Rows a horizontal legend of these names takes in a card (about 6 px a character
    and 40 for the swatch and gap): the figure grows by as many."""
    rows, used = 1, 0
    for name in parts:
        w = 40 + 6 * len(name)
        if used and used + w > _CARD_PX:
            rows, used = rows + 1, 0
        used += w
    return rows


def answers_html(answers: list[Answer], splits: dict[str, TimeSplit], wall_s: float) -> str:
    cards = []
    for a in answers:
        cls = _VERDICT_CSS[a.verdict]
        split = splits.get(a.question.id)
        chart = figure_div(split_chart(split), modebar=False) if split else ""
        cards.append(
            f'<div class="card" data-question="{esc(a.question.id)}"><h3>{esc(a.question.question)}</h3>'
            f'<p><span class="{cls}">{esc(a.verdict)}</span> {esc(a.answer)}</p>'
            + chart  # a few bars: nothing to zoom
            + "</div>"
        )
    return (
        '<section id="answers" data-section="answers"><h2>The answers</h2>'
        f'<p class="note">Each question is one comparison (baseline: without the optimisation); '
        "the verdict is a two-sided permutation test on the named metric, alpha 0.05; "
        "brackets are 95% bootstrap CIs. Each chart splits the question's figure into where "
        f"its time went, per configuration. The demo took {wall_s:.0f} s.</p>"
        '<div class="cards">' + "".join(cards) + "</div></section>"
    )


def write_demo_report(
    answers: list[Answer],
    comparisons: dict[str, Comparison],
    groups: dict[str, list[list[Run]]],
    diagnoses: dict[str, Diagnosis],
    splits: dict[str, TimeSplit],
    out: Path,
    wall_s: float,
) -> Path:
    details = []
    for a in answers:
        qid = a.question.id
        keep = {a.question.metric, a.question.cost}
        body = comparison_html(comparisons[qid], groups[qid], keep=keep)
        name = diagnoses[qid].run_name
        run = next(r for g in groups[qid] for r in g if r.name == name)
        body += f"<h3>One run: {esc(run.name)}</h3>" + run_sections(run, diagnoses[qid], f"{qid}-")
        details.append(
            f'<details data-section="details-{esc(qid)}"><summary><b>{esc(qid)}</b>: the full '
            f"comparison and one run</summary>{body}</details>"
        )
    css = CSS + (
        ".cards{display:grid;grid-template-columns:1fr 1fr;gap:12px}"
        ".card{background:#fff;border:1px solid #e3e3e3;border-radius:6px;padding:8px 14px}"
        ".card h3{font-size:15px}.card p{font-size:13px;margin:4px 0}"
        ".card .chart{min-height:0} details{margin:10px 0}"
    )
    doc = (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>servelab demo</title><style>{css}</style>"
        f"<script>{get_plotlyjs()}</script></head><body>"
        f"<header><h1>servelab demo: {len(answers)} questions</h1><div>how to read it: "
        "docs/reading-the-report.md</div></header><main>"
        + answers_html(answers, splits, wall_s)
        + '<section data-section="details"><h2>The details</h2>'
        + "".join(details)
        + "</section></main></body></html>"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc, encoding="utf-8")
    return out
