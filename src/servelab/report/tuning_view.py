"""`servelab tune` in the terminal and as an HTML page.

Both show the same four parts: the findings the decision rests on, the self-check (the
replay of the run as it ran against its measured figures), the decision (the chosen
setting with predicted before -> after per class, the best value of each other knob,
capacity, rejected and unpredicted candidates) and, after ``--verify``, each arm's predicted
against measured change with its paired test, whether the top-1 was measured best, the
MAPE of the predicted changes and the answer, then predicted against measured per class. Every HTML section carries
``data-section`` (``tune-findings``, ``tune-check``, ``tune-decision``, ``tune-verify``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from rich.console import Console
from rich.table import Table

from servelab.analyze.tuning.candidates import SEARCH_BUDGET, launch_action
from servelab.analyze.tuning.decision import Decision, Judged, moved
from servelab.analyze.tuning.prediction import (
    CHECKED,
    Prediction,
    Spread,
    is_latency,
    label,
)
from servelab.analyze.tuning.prediction import value_text as value
from servelab.analyze.tuning.result import Tuning
from servelab.analyze.tuning.verification import (
    AS_RUN,
    MAPE_LIMIT,
    TUNED,
    Change,
    Verification,
)
from servelab.report.html import CSS, esc, figure_div

# Per class, the figures shown before -> after for a decision.
SHOWN = ("ttft_p50", "ttft_p95", "itl_p99", "tpot_p50", "e2e_p95", "attainment")
_VERDICT_STYLE = {
    "ok": "green",
    "too_small": "yellow",
    "unsettled": "yellow",
    "strayed": "red",
    "unmeasured": "dim",
}


def spread_text(name: str, s: Spread | None) -> str:
    """``median (lo-hi)``, the range in the median's unit."""
    if s is None:
        return "-"
    if s.lo == s.hi:
        return value(name, s.median)
    if is_latency(name):
        scale, unit = (1e3, "ms") if s.median < 1 else (1.0, "s")
        return f"{s.median * scale:.3g} {unit} ({s.lo * scale:.3g}-{s.hi * scale:.3g})"
    if name == "attainment":
        return f"{s.median:.0%} ({s.lo:.0%}-{s.hi:.0%})"
    return f"{s.median:.3g} ({s.lo:.3g}-{s.hi:.3g})"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _where(scope: str, name: str) -> str:
    return label(name) + ("" if scope == "overall" else f" ({scope})")


def twin_text(twin: dict[str, Any]) -> str:
    """What a foreign run replays on: the twin's server, fit and each setting's source."""
    err = (twin.get("fit_error") or {}).get("median")
    spread = twin.get("speed_spread")
    fitted = (
        f"{twin['steps']} steps inferred from the streams"
        if twin.get("steps") is not None
        else "fitted to each request's first and last token times"
    )
    lines = [
        f"replayed on the twin of this {twin['server']} server, calibrated on the run: "
        f"{fitted}, step fit error median "
        + (f"{err:.0%}" if err is not None else "-")
        + f", API {twin['api_overhead_s'] * 1e3:.0f} ms a request, speed spread "
        + (f"{spread:.2f}" if spread is not None else "-")
        + f"; seed k > 0 runs on bootstrap refit k of {twin.get('bootstrap')}",
        "  settings (source):",
    ]
    for k, v in twin["engine_config"].items():
        lines.append(f"    {k} = {v} ({twin['engine_sources'].get(k) or '-'})")
    return "\n".join(lines)


def check_table(t: Tuning) -> Table | None:
    if t.check is None:
        return None
    tab = Table(
        title=f"self-check: each of {t.check.parts} held-out parts of the run replayed by a "
        f"model fitted to the rest, {t.seeds} simulator seeds (tolerance "
        f"{t.check.tolerance:.0%}; beyond it but inside the measured CI: unsettled; the part "
        "furthest off)",
        title_justify="left",
    )
    for col in ("scope", "figure", "measured", "replay (range)", "error", "verdict"):
        tab.add_column(col, justify="left" if col in ("scope", "figure", "verdict") else "right")
    for r in t.check.rows:
        style = _VERDICT_STYLE[r.verdict]
        tab.add_row(
            r.scope,
            label(r.name),
            value(r.name, r.measured),
            spread_text(r.name, r.replay),
            _pct(r.error),
            f"[{style}]{r.verdict}[/]",
        )
    return tab


def before_after_table(base: Prediction, j: Judged, names: tuple[str, ...] = SHOWN) -> Table:
    """Per class and figure: the as-run replay's median -> the candidate's, with the
    candidate's range over seeds."""
    tab = Table(title=f"predicted before -> after: {j.candidate.title}", title_justify="left")
    for col in ("scope", "figure", "as run", "after", "range over seeds"):
        tab.add_column(col, justify="left" if col in ("scope", "figure") else "right")
    for scope in base.scopes:
        for n in names:
            a, b = base.spread(scope, n), j.prediction.spread(scope, n)
            if b is None:
                continue
            tab.add_row(
                scope,
                label(n),
                value(n, a.median if a else None),
                value(n, b.median),
                f"{value(n, b.lo)} - {value(n, b.hi)}",
            )
    return tab


def per_class(base: Prediction, pred: Prediction, name: str) -> str:
    """``class before -> after`` of one figure for every class (medians over seeds)."""
    parts = []
    for scope in base.scopes:
        if scope == "overall":
            continue
        a, b = base.spread(scope, name), pred.spread(scope, name)
        if a is not None and b is not None:
            parts.append(f"{scope} {value(name, a.median)} -> {value(name, b.median)}")
    return "; ".join(parts) or "-"


def render_tuning(t: Tuning, console: Console) -> None:
    console.rule(f"[bold]tune: {t.run}")
    if t.findings:
        console.print("[bold]findings the candidates come from[/]")
        for f in t.findings:
            levers = ", ".join(f.levers) or "no lever"
            console.print(f"  [yellow]> {f.title}[/] [dim]({f.confidence_label}; {levers})[/]")
    elif not t.gated:  # a gated run was never diagnosed: its refusal is the answer
        console.print("[green]no findings[/]: nothing in this run calls for a change")
    if t.twin is not None:
        console.print(twin_text(t.twin))
    tab = check_table(t)
    if tab is not None:
        console.print(tab)
    if t.refused:
        console.print(f"[bold red]no prediction:[/] {t.refused}")
    d = t.decision
    if d is not None and t.baseline is not None:
        _render_decision(t, d, console)
    if t.verification is not None:
        _render_verification(t.verification, console)
    for note in t.notes:
        console.print(f"[dim]note: {note}[/]")
    if t.timings:
        parts = ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in t.timings.items())
        console.print(f"[dim]time: {parts}[/]")


def search_text(t: Tuning) -> str:
    """How far the search went: the candidates simulated against its budget."""
    singles = sum(j.candidate.knob != "combined" for j in t.judged)
    return (
        f"searched {singles} candidate setting(s) (budget {SEARCH_BUDGET}; any beyond it are "
        "listed as not predicted)"
    )


def _render_decision(t: Tuning, d: Decision, console: Console) -> None:
    assert t.baseline is not None
    console.rule(f"[bold]decision[/] (objective: {d.objective.text})")
    console.print(f"[dim]{search_text(t)}[/]")
    if d.chosen is None:
        console.print(
            "[bold]keep the run's config[/]: no candidate is predicted to improve both the "
            "objective and its own target (see the rejected ones below)"
        )
    else:
        c = d.chosen.candidate
        prio = ", ".join(f"{k}={v}" for k, v in c.priorities.items())
        console.print(f"[bold green]apply: {c.title}[/]")
        if c.engine:
            console.print(f"  {launch_action(t.server, c.engine)}")
        if prio:
            console.print(f"  class priorities (lower first): {prio}")
        console.print(f"  predicted: {d.chosen.reason}")
        if c.because:
            console.print(f"  called for by {c.because}")
        if d.why:
            console.print(f"  why this one: {d.why}")
        console.print(f"  cost: {c.cost}; predicted to pay: {d.chosen.pays}")
        if c.operates:
            console.print(f"  to operate ({c.complexity}): {c.operates}")
        console.print(before_after_table(t.baseline, d.chosen))
    if len(d.ranked) > 1:
        obj = d.objective
        tab = Table(title="the best value of each knob", title_justify="left")
        for col in ("setting", "objective", f"{label(obj.figure)} per class", "target", "cost"):
            tab.add_column(col, justify="left")
        for j in d.ranked:
            sc, fig = j.candidate.target
            tab.add_row(
                j.candidate.title,
                moved(j.objective_gain, obj.figure),
                per_class(t.baseline, j.prediction, obj.figure),
                f"{_where(sc, fig)} {moved(j.target_gain, fig)}",
                j.candidate.cost,
            )
        console.print(tab)
    if d.capacity:
        console.print("[bold]capacity[/] (more hardware, not a setting of this machine):")
        for j in d.capacity:
            console.print(f"  {j.candidate.title}: {j.reason}; cost {j.candidate.cost}")
    if d.rejected:
        console.print("[bold]considered and rejected[/]")
        for r in d.rejected:
            console.print(f"  [dim]- {r.candidate.title}:[/] {r.reason}")
    if d.unpredicted:
        console.print("[bold]not predicted[/]")
        for u in d.unpredicted:
            console.print(f"  [dim]- {u.lever}:[/] {u.reason}")


def _figure(c: Change) -> str:
    return label(c.name) + ("" if c.scope == "overall" else f" {c.scope}")


def _p(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def change_rows(v: Verification) -> list[list[str]]:
    """Per arm and figure tested: arm, figure, predicted, measured (per repeat), p, error."""
    rows = []
    for a in v.arms:
        for c in a.changes:
            reps = " ".join(f"{x:+.0%}" for x in c.per_repeat)
            rows.append(
                [
                    a.name,
                    _figure(c),
                    _pct(c.predicted),
                    f"{_pct(c.measured)} ({reps})" if reps else _pct(c.measured),
                    _p(c.p_value),
                    "-" if c.error is None else f"{c.error:.1%}",
                ]
            )
    return rows


def verdict_lines(v: Verification) -> list[str]:
    """The arms' settings, which was measured best, the MAPE, the answer."""
    lines = [f"{a.name}: {a.title}" for a in v.arms]
    best = "the top-1" if v.top1_best else f"{v.best}, not the top-1"
    lines.append(f"measured best on the objective: {best}")
    if v.mape is not None:
        way = "within" if v.mape_ok else "beyond"
        lines.append(f"MAPE of the predicted changes: {v.mape:.1%} ({way} {MAPE_LIMIT:.0%})")
    return lines


def _render_verification(v: Verification, console: Console) -> None:
    seeds = ", ".join(map(str, v.plan_seeds))
    console.rule(
        f"[bold]verified[/] ({v.repeats} repeat(s), fresh requests each"
        + (f": plan seeds {seeds})" if seeds else ")")
    )
    test = v.arms[0].objective.test if v.arms else "-"
    changes = Table(
        title=f"change against the as-run arm (measured: mean, per repeat); p: {test}",
        title_justify="left",
    )
    for h in ("arm", "figure", "predicted", "measured", "p", "error"):
        changes.add_column(h, justify="left" if h in ("arm", "figure") else "right")
    for row in change_rows(v):
        changes.add_row(*row)
    console.print(changes)
    for line in verdict_lines(v):
        console.print(f"  {line}")
    tab = Table(
        title="predicted: median (range over seeds); measured: mean of the repeats",
        title_justify="left",
    )
    tab.add_column("scope", justify="left")
    tab.add_column("figure", justify="left")
    for cfg in (AS_RUN, TUNED):
        tab.add_column(f"{cfg} predicted", justify="right")
        tab.add_column(f"{cfg} measured", justify="right")
    keys = list(dict.fromkeys((r.scope, r.name) for r in v.rows))
    by = {(r.config, r.scope, r.name): r for r in v.rows}
    for scope, name in keys:
        cells = []
        for cfg in (AS_RUN, TUNED):
            r = by.get((cfg, scope, name))
            if r is None:
                cells += ["-", "-"]
                continue
            mark = "" if r.inside is None else (" [green]in[/]" if r.inside else " [yellow]out[/]")
            cells += [spread_text(name, r.predicted), value(name, r.measured) + mark]
        tab.add_row(scope, label(name), *cells)
    console.print(tab)
    style = "green" if v.answer == "apply" else "yellow"
    console.print(f"[{style}]{v.answer}[/]: {v.sentence}")


# --------------------------------------------------------------------------- HTML


def _table_html(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(f'<td class="{"l" if i < 2 else ""}">{c}</td>' for i, c in enumerate(r))
        + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def check_html(t: Tuning) -> str:
    if t.check is None:
        return ""
    rows = [
        [
            esc(r.scope),
            esc(label(r.name)),
            esc(value(r.name, r.measured)),
            esc(spread_text(r.name, r.replay)),
            esc(_pct(r.error)),
            f'<span class="{ {"ok": "better", "strayed": "worse"}.get(r.verdict, "noise") }">'
            f"{esc(r.verdict)}</span>",
        ]
        for r in t.check.rows
    ]
    twin = f'<pre class="note">{esc(twin_text(t.twin))}</pre>' if t.twin is not None else ""
    return (
        '<section data-section="tune-check"><h2>Self-check: the run replayed out of sample'
        "</h2>"
        + twin
        + f'<p class="note">Each of {t.check.parts} held-out parts of the run (alternating '
        "time windows) replayed by a model fitted to the rest of it: median [range] over "
        f"{t.seeds} simulator seeds against the measured figure of the same requests, in the "
        f"part furthest off; tolerance {t.check.tolerance:.0%}, and a figure off by more "
        "strays only outside the measured figure's confidence interval (<i>unsettled</i>: "
        "off by more, but within the part's own sampling noise, so neither blamed nor "
        "passed). <i>too_small</i>: a part has "
        "too few values to pin the figure down, so it is not checked.</p>"
        + _table_html(["scope", "figure", "measured", "replay", "error", "verdict"], rows)
        + "</section>"
    )


def decision_html(t: Tuning) -> str:
    d = t.decision
    if d is None or t.baseline is None:
        return ""
    parts = [
        f'<section data-section="tune-decision"><h2>Decision</h2><p>Objective: {esc(d.objective.text)}.</p>',
        f"<p>{esc(search_text(t))}</p>",
    ]
    if d.chosen is None:
        parts.append("<p><b>Keep the run's config</b>: no candidate is predicted to pay.</p>")
    else:
        c = d.chosen.candidate
        parts.append(
            f"<p><b>Apply: {esc(c.title)}</b>. Predicted: {esc(d.chosen.reason)}. "
            + (f"Why this one: {esc(d.why)}. " if d.why else "")
            + f"Cost: {esc(c.cost)}; predicted to pay: {esc(d.chosen.pays)}."
            + (f" To operate ({esc(c.complexity)}): {esc(c.operates)}." if c.operates else "")
            + "</p>"
        )
        if c.engine:
            parts.append(f"<p><code>{esc(launch_action(t.server, c.engine))}</code></p>")
        rows = []
        for scope in t.baseline.scopes:
            row = [esc(scope)]
            for n in SHOWN:
                a, b = t.baseline.spread(scope, n), d.chosen.prediction.spread(scope, n)
                row.append(esc(f"{value(n, a.median if a else None)} -> {spread_text(n, b)}"))
            rows.append(row)
        parts.append(_table_html(["scope", *(label(n) for n in SHOWN)], rows))
    if d.rejected or d.unpredicted:
        items = [f"<li>{esc(r.candidate.title)}: {esc(r.reason)}</li>" for r in d.rejected] + [
            f"<li>{esc(u.lever)} (not predicted): {esc(u.reason)}</li>" for u in d.unpredicted
        ]
        parts.append(
            "<details><summary>considered and rejected</summary><ul>"
            + "".join(items)
            + "</ul></details>"
        )
    parts.append("</section>")
    return "".join(parts)


def verification_chart(v: Verification, names: tuple[str, ...] = CHECKED) -> go.Figure:
    """Per scope and latency figure: predicted (median, range as error bars) beside measured,
    for both configurations."""
    fig = go.Figure()
    keys = [(r.scope, r.name) for r in v.rows if r.config == TUNED and r.name in names]
    keys = [k for k in keys if is_latency(k[1])]
    by = {(r.config, r.scope, r.name): r for r in v.rows}
    xs = [f"{s} {label(n)}" for s, n in keys]
    colors = {AS_RUN: ("#9aa5b1", "#5f6b77"), TUNED: ("#8fbce6", "#1f77b4")}
    for cfg in (AS_RUN, TUNED):
        pred = [by.get((cfg, *k)) for k in keys]
        med = [(r.predicted.median * 1e3) if r and r.predicted else None for r in pred]
        fig.add_bar(
            name=f"{cfg} predicted",
            x=xs,
            y=med,
            marker_color=colors[cfg][0],
            error_y={
                "type": "data",
                "symmetric": False,
                "array": [
                    (r.predicted.hi * 1e3 - m) if r and r.predicted and m is not None else 0
                    for r, m in zip(pred, med)
                ],
                "arrayminus": [
                    (m - r.predicted.lo * 1e3) if r and r.predicted and m is not None else 0
                    for r, m in zip(pred, med)
                ],
            },
        )
        fig.add_bar(
            name=f"{cfg} measured",
            x=xs,
            y=[(r.measured * 1e3) if r and r.measured is not None else None for r in pred],
            marker_color=colors[cfg][1],
        )
    fig.update_layout(
        barmode="group",
        height=420,
        template="plotly_white",
        title={"text": "predicted (range over seeds) vs measured, ms", "font": {"size": 14}},
        yaxis={"type": "log"},
    )
    return fig


def verification_html(v: Verification | None) -> str:
    if v is None:
        return ""
    rows = []
    for r in v.rows:
        rows.append(
            [
                esc(r.config),
                esc(f"{r.scope} {label(r.name)}"),
                esc(spread_text(r.name, r.predicted)),
                esc(value(r.name, r.measured)),
                esc(_pct(r.error)),
                esc("-" if r.inside is None else ("inside" if r.inside else "outside")),
            ]
        )
    changes = [[esc(c) for c in row] for row in change_rows(v)]
    return (
        '<section data-section="tune-verify"><h2>Verified: predicted vs measured</h2>'
        f'<p><span class="{"better" if v.answer == "apply" else "noise"}">'
        f"{esc(v.answer)}</span> {esc(v.sentence)}</p>"
        + _table_html(["arm", "figure", "predicted", "measured", "p", "error"], changes)
        + "".join(f'<p class="note">{esc(line)}</p>' for line in verdict_lines(v))
        + figure_div(verification_chart(v))
        + _table_html(["config", "figure", "predicted", "measured", "error", "range"], rows)
        + "</section>"
    )


def tuning_html(t: Tuning) -> str:
    findings = "".join(
        f'<div class="finding"><b>{esc(f.title)}</b> ({esc(f.confidence_label)}): '
        f"{esc(f.summary)}</div>"
        for f in t.findings
    )
    refused = f'<div class="warn">No prediction: {esc(t.refused)}</div>' if t.refused else ""
    notes = "".join(f'<p class="note">{esc(n)}</p>' for n in t.notes)
    return (
        f'<section data-section="tune-findings"><h2>Findings</h2>{findings or "none"}{refused}</section>'
        + check_html(t)
        + decision_html(t)
        + verification_html(t.verification)
        + (f'<section data-section="tune-notes"><h2>Notes</h2>{notes}</section>' if notes else "")
    )


def write_tuning_report(t: Tuning, out: Path) -> Path:
    doc = (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>servelab tune: {esc(t.run)}</title><style>{CSS}</style>"
        f"<script>{get_plotlyjs()}</script></head><body>"
        f"<header><h1>servelab tune: {esc(t.run)}</h1><div>docs/design/tune.md</div></header>"
        "<main>" + tuning_html(t) + "</main></body></html>"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc, encoding="utf-8")
    return out
