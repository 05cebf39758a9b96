"""The demo's HTML report: it opens with the four answers (one sentence, one small chart
each), then folds the full comparisons and one run's sections per question into
collapsed ``<details>``.
"""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from servelab.analyze.answers import Answer
from servelab.analyze.compare import Comparison
from servelab.analyze.diagnose import Diagnosis
from servelab.report.html import CSS, comparison_html, esc, figure_div, run_sections
from servelab.rundir import Run

_VERDICT_CSS = {"significant": "better", "noise": "noise"}


def answer_chart(a: Answer) -> go.Figure:
    """Baseline vs treatment on the key metric, with the 95% CIs as error bars."""
    k = a.key
    vals = [(k.baseline_value or 0) * 1e3, (k.treatment_value or 0) * 1e3]
    cis = [k.baseline_ci, k.treatment_ci]
    fig = go.Figure(
        go.Bar(
            x=[a.question.baseline, a.question.treatment],
            y=vals,
            marker_color=["#9aa5b1", "#1f77b4"],
            error_y={
                "type": "data",
                "symmetric": False,
                "array": [(c[1] * 1e3 - v) if c else 0 for c, v in zip(cis, vals)],
                "arrayminus": [(v - c[0] * 1e3) if c else 0 for c, v in zip(cis, vals)],
            },
        )
    )
    fig.update_layout(
        height=220,
        margin={"l": 50, "r": 10, "t": 30, "b": 30},
        title={"text": f"{k.label} (ms)", "font": {"size": 13}},
        template="plotly_white",
    )
    return fig


def answers_html(answers: list[Answer], wall_s: float) -> str:
    cards = []
    for a in answers:
        cls = _VERDICT_CSS[a.verdict]
        cards.append(
            f'<div class="card" data-question="{esc(a.question.id)}"><h3>{esc(a.question.question)}</h3>'
            f'<p><span class="{cls}">{esc(a.verdict)}</span> {esc(a.answer)}</p>'
            + figure_div(answer_chart(a), modebar=False)  # two bars: nothing to zoom
            + "</div>"
        )
    return (
        '<section id="answers" data-section="answers"><h2>The answers</h2>'
        f'<p class="note">Each question is one comparison (baseline: without the optimisation); '
        "the verdict is a two-sided permutation test on the named metric, alpha 0.05; "
        f"brackets are 95% bootstrap CIs. The demo took {wall_s:.0f} s.</p>"
        '<div class="cards">' + "".join(cards) + "</div></section>"
    )


def write_demo_report(
    answers: list[Answer],
    comparisons: dict[str, Comparison],
    groups: dict[str, list[list[Run]]],
    diagnoses: dict[str, Diagnosis],
    out: Path,
    wall_s: float,
) -> Path:
    details = []
    for a in answers:
        qid = a.question.id
        keep = {a.question.metric, a.question.cost}
        body = comparison_html(comparisons[qid], groups[qid], keep=keep)
        run = groups[qid][-1][0]
        body += f"<h3>One run: {esc(run.name)}</h3>" + run_sections(run, diagnoses[qid], f"{qid}-")
        details.append(
            f'<details data-section="details-{esc(qid)}"><summary><b>{esc(qid)}</b>: the full '
            f"comparison and one run</summary>{body}</details>"
        )
    css = CSS + (
        ".cards{display:grid;grid-template-columns:1fr 1fr;gap:12px}"
        ".card{background:#fff;border:1px solid #e3e3e3;border-radius:6px;padding:8px 14px}"
        ".card h3{font-size:15px}.card p{font-size:13px;margin:4px 0}"
        ".card .chart{min-height:220px} details{margin:10px 0}"
    )
    doc = (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>servelab demo</title><style>{css}</style>"
        f"<script>{get_plotlyjs()}</script></head><body>"
        "<header><h1>servelab demo: four questions</h1><div>how to read it: "
        "docs/reading-the-report.md</div></header><main>"
        + answers_html(answers, wall_s)
        + '<section data-section="details"><h2>The details</h2>'
        + "".join(details)
        + "</section></main></body></html>"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc, encoding="utf-8")
    return out
