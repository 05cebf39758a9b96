"""Rich tables for the terminal: diagnosis, comparison and the run summary.

Only draws; every number comes from diagnose / compare / summary.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from servelab.analyze.attribution import STALL_FACTOR
from servelab.analyze.compare import Comparison
from servelab.analyze.diagnose import Diagnosis

PART_LABELS = {
    "client_lag": "client lag (intended -> actual send)",
    "network_http": "network + HTTP + tokenisation",
    "queue": "server queueing",
    "prefill": "prefill compute",
    "interference": "interference (others' work in its steps)",
    "preemption": "preemption (re-queue + recompute)",
    "overhead": "engine overhead between steps",
}


def ms(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x * 1e3:.{digits}f}"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def render_diagnosis(d: Diagnosis, console: Console) -> None:
    console.rule(f"[bold]diagnosis: {d.run_name}")
    console.print(
        f"target: {d.target_kind}   attribution: [bold]{d.source}[/]"
        + ("" if d.source == "exact" else "  (see notes for what is estimated)")
    )
    if d.overall is not None:
        t = Table(
            title="Where TTFT went (mean ms per request; shares add up to TTFT from intended send)"
        )
        t.add_column("part")
        t.add_column("all", justify="right")
        t.add_column("share", justify="right")
        if d.tail is not None:
            t.add_column("slowest 10%", justify="right")
            t.add_column("share", justify="right")
        for cls in d.by_class:
            t.add_column(cls, justify="right")
        t.add_column("how")
        for part, v in d.overall.parts.items():
            row = [PART_LABELS.get(part, part), ms(v), f"{d.overall.shares[part]:.0%}"]
            if d.tail is not None:
                tv = d.tail.parts.get(part)
                row += [ms(tv), f"{d.tail.shares.get(part, 0.0):.0%}"]
            row += [ms(tab.parts.get(part)) for tab in d.by_class.values()]
            row.append(d.part_sources.get(part, ""))
            t.add_row(*row)
        t.add_row(
            "[bold]TTFT (from actual send)",
            ms(d.overall.ttft_mean),
            "",
            *([ms(d.tail.ttft_mean), ""] if d.tail else []),
            *[ms(tab.ttft_mean) for tab in d.by_class.values()],
            "",
        )
        console.print(t)
    if d.stalls_by_cause:
        t = Table(title=f"ITL stalls (gaps >= {STALL_FACTOR:g}x the request's median) by cause")
        t.add_column("cause")
        t.add_column("count", justify="right")
        t.add_column("time lost (s)", justify="right")
        for cause, v in sorted(d.stalls_by_cause.items(), key=lambda kv: -kv[1]["excess_seconds"]):
            t.add_row(cause, str(int(v["count"])), f"{v['excess_seconds']:.2f}")
        console.print(t)
    if not d.findings:
        console.print("[green]No findings: no cause is large enough to move a percentile.")
    else:
        console.rule("Findings", style="dim")
    for f in d.findings:
        how = "exact" if f.exact else "estimate"
        console.print(
            f"[bold yellow]> {f.title}[/]  [dim](confidence {f.confidence_label} "
            f"{f.confidence:.2f}, {how})[/]"
        )
        console.print(f"  {f.summary}")
        ev = ", ".join(f"{k}={_fmt(v)}" for k, v in f.evidence.items())
        console.print(f"  [dim]evidence: {ev}[/]", overflow="fold")
    recommended = [r for r in d.recommendations if r.recommended]
    if recommended:
        console.rule("Recommendations", style="dim")
    for r in recommended:
        console.print(
            f"[bold cyan]> {r.title}[/]  [dim](for {', '.join(r.because)}; "
            f"complexity {r.complexity})[/]"
        )
        g = Table.grid(padding=(0, 1))
        g.add_column(style="bold", no_wrap=True)
        g.add_column(overflow="fold")
        g.add_row("  do", r.action)
        g.add_row("  gain", r.expected_gain)
        g.add_row("  cost", r.cost)
        g.add_row("  not worth it", r.not_worth_it_when)
        console.print(g)
    for r in d.recommendations:
        if not r.recommended:
            console.print(f"[dim]considered, not recommended here: {r.title}: {r.why_not}[/]")
    for n in d.notes:
        console.print(f"[dim]note: {n}")


_VERDICT_STYLE = {"better": "green", "worse": "red", "noise": "dim"}


def _value(metric: str, v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if "." in metric else ms(v)


def render_comparison(
    c: Comparison,
    console: Console,
    scopes: tuple[str, ...] | None = None,
    stats: tuple[str, ...] | None = None,
) -> None:
    """The comparison tables; ``scopes``/``stats`` keep only those rows (rates always shown)."""
    console.rule("[bold]comparison (first run is the baseline)")
    for w in c.warnings:
        console.print(f"[yellow]warning: {w}")
    all_scopes = list(dict.fromkeys(r.scope for r in c.rows))
    for scope in [s for s in all_scopes if scopes is None or s in scopes]:
        t = Table(title=f"{scope}: latencies in ms, rates per second")
        t.add_column("metric")
        for i, label in enumerate(c.labels):
            t.add_column(label, justify="right")
            if i:
                t.add_column("delta", justify="right")
                t.add_column("p", justify="right")
                t.add_column("verdict")
        rows = [r for r in c.rows if r.scope == scope]
        for r in (r for r in rows if stats is None or r.stat in stats or r.stat == "value"):
            cells = [f"{r.metric} {r.stat}" if r.stat != "value" else r.metric]
            for i in range(len(c.labels)):
                cells.append(_value(r.metric, r.values[i]))
                if i:
                    d = r.delta[i]
                    verdict = r.verdict(i)
                    style = _VERDICT_STYLE.get(verdict, "")
                    cells += [
                        "-" if d is None else f"{d:+.1%}",
                        "-" if r.p[i] is None else f"{r.p[i]:.3f}",
                        f"[{style}]{verdict}[/]" if style else verdict,
                    ]
            t.add_row(*cells)
        console.print(t)
    for n in c.notes:
        console.print(f"[dim]note: {n}")


def render_summary(name: str, metrics: dict[str, Any], console: Console) -> None:
    """One line per class (and overall) with the headline percentiles and rates."""
    t = Table(title=f"{name}: summary (latencies in ms)")
    for col in (
        "class",
        "requests",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "TPOT p50",
        "E2E p50",
        "out tok/s",
        "goodput",
    ):
        t.add_column(col, justify="right" if col != "class" else "left")
    groups = [("overall", metrics["overall"])] + list(metrics.get("by_class", {}).items())
    for label, g in groups:
        lat = g["latency"]
        good = g["goodput"]["fraction"]
        tput = g["throughput"]["output_tokens_per_s"]
        t.add_row(
            label,
            f"{g['requests']['ok']}/{g['requests']['sent']}",
            ms(lat["ttft"]["p50"]),
            ms(lat["ttft"]["p99"]),
            ms(lat["itl"]["p50"]),
            ms(lat["itl"]["p99"]),
            ms(lat["tpot"]["p50"]),
            ms(lat["e2e"]["p50"]),
            "-" if tput is None else f"{tput:.1f}",
            "-" if good is None else f"{good:.0%}",
        )
    console.print(t)
