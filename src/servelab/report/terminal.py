"""Every rich table servelab prints: the run summary, rates, stages, diagnosis, comparison,
and the engine's per-request timelines.

Only draws; every number comes from ``summarize``, diagnose, compare or a timeline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from servelab.analyze.answers import Answer
from servelab.analyze.compare import Comparison
from servelab.analyze.diagnosis.attribution import STALL_FACTOR
from servelab.analyze.diagnosis.diagnose import Diagnosis
from servelab.analyze.summary import run_summary
from servelab.report.windows import rates_text, window_label
from servelab.units import fmt_ms

if TYPE_CHECKING:
    from servelab.rundir import Run
    from servelab.vocab import RequestTimeline

MAX_WINDOW_ROWS = 120  # a terminal table of more time windows than this is not read

PART_LABELS = {
    "client_lag": "client lag (intended -> actual send)",
    "connection": "waiting for a connection (new: DNS + connect + TLS)",
    "sending": "sending the request",
    "network_http": "network + HTTP + tokenisation",
    "queue": "server queueing",
    "prefill": "prefill compute",
    "interference": "interference (others' work in its steps)",
    "preemption": "preemption (re-queue + recompute)",
    "overhead": "engine overhead between steps",
}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def fit(table: Table, console: Console, droppable: list[str]) -> Table:
    """Drop columns (by header, in the order given) until no cell must wrap or be cut at
    the console's width: a narrow terminal loses detail columns, never digits."""
    for header in droppable:
        wide = console.options.update(width=10_000)
        if Measurement.get(console, wide, table).maximum <= console.width:
            break
        for i, col in enumerate(table.columns):
            if col.header == header:
                del table.columns[i]
                break
    return table


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
            row = [PART_LABELS.get(part, part), fmt_ms(v), f"{d.overall.shares[part]:.0%}"]
            if d.tail is not None:
                tv = d.tail.parts.get(part)
                row += [fmt_ms(tv), f"{d.tail.shares.get(part, 0.0):.0%}"]
            row += [fmt_ms(tab.parts.get(part)) for tab in d.by_class.values()]
            row.append(d.part_sources.get(part, ""))
            t.add_row(*row)
        t.add_row(
            "[bold]TTFT (from actual send)",
            fmt_ms(d.overall.ttft_mean),
            "",
            *([fmt_ms(d.tail.ttft_mean), ""] if d.tail else []),
            *[fmt_ms(tab.ttft_mean) for tab in d.by_class.values()],
            "",
        )
        # Least telling first: how each part was measured, then per-class, then the tail.
        console.print(fit(t, console, ["how", *reversed(d.by_class), "share", "slowest 10%"]))
    if d.stalls_by_cause:
        t = Table(title=f"ITL stalls (gaps >= {STALL_FACTOR:g}x the request's median) by cause")
        t.add_column("cause")
        t.add_column("count", justify="right")
        t.add_column("time lost (s)", justify="right")
        by_loss = sorted(d.stalls_by_cause.items(), key=lambda kv: -kv[1]["excess_seconds"])
        for cause, lost in by_loss:
            t.add_row(cause, str(int(lost["count"])), f"{lost['excess_seconds']:.2f}")
        console.print(t)
    if d.timeslices is not None:
        print_timeslices({"timeslices": d.timeslices}, console)
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
    if recommended:
        console.print(
            "[dim]These gains are first-order estimates. `servelab tune RUN` replays this run's "
            "own requests under each setting, chooses one, and `--verify` runs it for real.[/]"
        )
    for n in d.notes:
        console.print(f"[dim]note: {n}")


_VERDICT_STYLE = {"better": "green", "worse": "red", "noise": "dim"}


def _value(metric: str, v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if "." in metric else fmt_ms(v)


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


def _figures_table(title: str, label: str, figures: tuple[str, ...], **table: Any) -> Table:
    """A table whose first column (``label``) names the row and whose ``figures`` columns,
    right-justified, hold numbers; ``table`` goes to rich's ``Table``."""
    t = Table(title=title, **table)
    t.add_column(label, justify="left")
    for col in figures:
        t.add_column(col, justify="right")
    return t


def render_summary(name: str, metrics: dict[str, Any], console: Console) -> None:
    """One line per class (and overall) with the headline percentiles and rates."""
    t = _figures_table(
        f"{name}: summary (latencies in ms)",
        "class",
        (
            "requests",
            "TTFT p50",
            "TTFT p99",
            "ITL p50",
            "ITL p99",
            "TPOT p50",
            "E2E p50",
            "out tok/s",
            "goodput",
        ),
    )
    groups = [("overall", metrics["overall"])] + list(metrics.get("by_class", {}).items())
    for label, g in groups:
        lat = g["latency"]
        good = g["goodput"]["fraction"]
        tput = g["throughput"]["output_tokens_per_s"]
        t.add_row(
            label,
            f"{g['requests']['ok']}/{g['requests']['sent']}",
            fmt_ms(lat["ttft"]["p50"]),
            fmt_ms(lat["ttft"]["p99"]),
            fmt_ms(lat["itl"]["p50"]),
            fmt_ms(lat["itl"]["p99"]),
            fmt_ms(lat["tpot"]["p50"]),
            fmt_ms(lat["e2e"]["p50"]),
            "-" if tput is None else f"{tput:.1f}",
            "-" if good is None else f"{good:.0%}",
        )
    console.print(fit(t, console, ["TPOT p50", "goodput", "E2E p50", "out tok/s"]))


def _ms0(x: float | None) -> str:
    return fmt_ms(x, digits=0, sep=",")


def timeline_table(timelines: list[RequestTimeline], title: str = "Request timelines") -> Table:
    """One row per request: queue, prefill chunks, cached tokens, TTFT, decode, tokens/s."""
    table = _figures_table(
        f"{title} (times in ms)",
        "request",
        (
            "prompt",
            "cached",
            "queue",
            "chunks",
            "prefill",
            "TTFT",
            "out",
            "decode",
            "tok/s",
            "preempt",
            "finish",
        ),
    )
    for t in timelines:
        ttft = None if t.first_token is None else t.first_token - t.arrival
        rate = (t.output_tokens - 1) / t.decode_time if t.decode_time > 0 else None
        chunks = "+".join(str(c.tokens) for c in t.chunks) or "-"
        table.add_row(
            t.request_id,
            str(t.prompt_tokens),
            str(t.cached_tokens),
            _ms0(t.queue_time),
            chunks,
            _ms0(t.prefill_time),
            _ms0(ttft),
            str(t.output_tokens),
            _ms0(t.decode_time),
            "-" if rate is None else f"{rate:.1f}",
            str(len(t.preemptions)),
            t.finish_reason.value if t.finish_reason else "-",
        )
    return table


def phase_table(t: RequestTimeline) -> Table:
    """One request's phases in order: queue, prefill chunks, first token, decode, finish."""
    from rich.table import Table

    table = Table(title=f"Timeline of {t.request_id} (ms from arrival)")
    table.add_column("phase")
    for col in ("at", "took", "tokens"):
        table.add_column(col, justify="right")
    table.add_column("detail")

    def rel(x: float) -> str:
        return _ms0(x - t.arrival)

    events: list[tuple[float, tuple[str, ...]]] = []
    for x in t.queued:
        events.append((x, ("queued", rel(x), "", "", "")))
    for x in t.scheduled:
        events.append((x, ("admitted", rel(x), "", "", "")))
    for x in t.preemptions:
        events.append((x, ("preempted", rel(x), "", "", "back to the queue; recomputed later")))
    for c in t.chunks:
        detail = f"step {c.step_id}" + (f", {c.cached_tokens} cached" if c.cached_tokens else "")
        row = ("prefill chunk", rel(c.start), _ms0(c.end - c.start), str(c.tokens), detail)
        events.append((c.start, row))
    if t.first_token is not None:
        events.append((t.first_token, ("first token", rel(t.first_token), "", "1", "TTFT")))
        if t.finished is not None and t.output_tokens > 1:
            rate = (t.output_tokens - 1) / t.decode_time if t.decode_time > 0 else 0.0
            decode = ("decode", rel(t.first_token), _ms0(t.decode_time), str(t.output_tokens - 1))
            events.append((t.first_token, (*decode, f"{rate:.1f} tok/s")))
    if t.finished is not None:
        reason = t.finish_reason.value if t.finish_reason else ""
        events.append((t.finished, ("finished", rel(t.finished), "", "", reason)))
    for _, cells in sorted(events, key=lambda e: e[0]):  # stable: same-time rows keep order
        table.add_row(*cells)
    return table


def _ms1(x: float | None) -> str:
    return fmt_ms(x, sep=",")


def _ci(stat: dict[str, Any], key: str) -> str:
    ci = stat.get("ci", {}).get(key)
    return "" if not ci else f" [{ci[0] * 1e3:,.1f}-{ci[1] * 1e3:,.1f}]"


def _saturation(summary: dict[str, Any]) -> dict[str, Any]:
    return (summary.get("timeslices") or {}).get("saturation") or {}


def summary_table(title: str, summary: dict[str, Any]) -> Table:
    """Latency percentiles (ms, with CIs for p50/p99) of one summary's overall group."""
    o = summary["overall"]
    if _saturation(summary).get("length_dependent"):
        title += " [bold red](over-saturated: percentiles depend on the run's length)[/]"
    t = _figures_table(
        title,
        "metric (ms)",
        ("n", "p50 [95% CI]", "p90", "p95", "p99 [95% CI]", "mean", "max"),
        title_justify="left",
    )
    names = {
        "ttft": "TTFT",
        "ttfo": "TTFO (first non-reasoning)",
        "ttft_intended": "TTFT from intended send",
        "itl": "ITL",
        "tpot": "TPOT",
        "e2e": "E2E",
    }
    for key, name in names.items():
        s = o["latency"].get(key)
        if not s or not s["n"] or (key == "ttfo" and not o.get("reasoning_tokens")):
            continue  # TTFO is TTFT when nothing was reasoning
        t.add_row(
            name,
            str(s["n"]),
            _ms1(s["p50"]) + _ci(s, "p50"),
            _ms1(s["p90"]),
            _ms1(s["p95"]),
            _ms1(s["p99"]) + _ci(s, "p99"),
            _ms1(s["mean"]),
            _ms1(s["max"]),
        )
    return t


def saturation_line(summary: dict[str, Any]) -> str:
    """Steady state, over-saturated or cannot tell, with offered vs achieved request rate."""
    ts = summary.get("timeslices")
    if not ts:
        return "steady state: not assessed (no time windows in this summary)"
    sat = ts["saturation"]
    rates = rates_text(ts, lambda x: f"{x:.3g}")
    if sat["state"] == "over_saturated":
        growth = sat["ttft_p50_trend"]["slope_per_minute"] * 1e3
        return (
            f"[bold red]over-saturated[/]: {rates}; TTFT p50 grew {growth:,.0f} ms per minute "
            f"({sat['reason']})"
        )
    if sat["state"] == "steady":
        return f"steady state: {rates} ({sat['reason']})"
    return f"steady state: cannot tell: {sat['reason']}; {rates}"


def print_timeslices(summary: dict[str, Any], console: Console) -> None:
    """The time-window table (narrowed to the terminal) and the steady-state line."""
    if (windows := slices_table(summary)) is not None:
        console.print(fit(windows, console, ["E2E p50", "ITL p99", "TTFT p99"]))
    console.print(saturation_line(summary))


def slices_table(summary: dict[str, Any]) -> Table | None:
    """One row per time window: rates, queue depth and latency percentiles; above
    ``MAX_WINDOW_ROWS`` windows, that many evenly spaced ones (first and last included),
    as the title says."""
    ts = summary.get("timeslices")
    if not ts or not ts["slices"]:
        return None
    windows = ts["slices"]
    shown = ""
    if len(windows) > MAX_WINDOW_ROWS:
        step = (len(windows) - 1) / (MAX_WINDOW_ROWS - 1)
        windows = [windows[round(k * step)] for k in range(MAX_WINDOW_ROWS)]
        shown = (
            f"; showing {MAX_WINDOW_ROWS} of {len(ts['slices']):,}, evenly spaced "
            "(all in --json and the HTML report)"
        )
    t = _figures_table(
        f"time windows of {ts['slice_duration_s']:g} s (queue depth: {ts['depth_source']})" + shown,
        "window (s)",
        (
            "sent",
            "offered/s",
            "achieved/s",
            "queue",
            "TTFT p50",
            "TTFT p99",
            "ITL p99",
            "E2E p50",
        ),
        title_justify="left",
    )
    for w in windows:
        depth = w["queue_depth"]
        t.add_row(
            window_label(w),
            str(w["sent"]),
            f"{w['offered_rate']:.2f}",
            f"{w['achieved_rate']:.2f}",
            "-" if depth is None else f"{depth:.1f}",
            _ms0(w["ttft"]["p50"]),
            _ms0(w["ttft"]["p99"]),
            _ms0(w["itl"]["p99"]),
            _ms0(w["e2e"]["p50"]),
        )
    return t


def similarity_line(summary: dict[str, Any]) -> str:
    """Request similarity: the ideal prefix reuse of what was sent beside the server's
    measured prefix-cache hit rate, overall and per class."""

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1%}"

    groups = {"overall": summary["overall"], **summary["by_class"]}
    parts = [
        f"{k} {pct(g.get('prefix_reuse_ideal'))} ideal / {pct(g.get('prefix_cache_hit_rate'))} hit"
        for k, g in groups.items()
    ]
    block = (summary.get("similarity") or {}).get("block_size")
    where = f" (ideal: {block}-token blocks, in send order)" if block else ""
    return "prefix reuse" + where + ": " + "; ".join(parts)


def rates_table(summary: dict[str, Any]) -> Table:
    """Throughput and goodput overall and per class."""
    t = _figures_table(
        "throughput over the measured window",
        "group",
        (
            "sent",
            "failed",
            "req/s",
            "in tok/s",
            "out tok/s",
            "goodput req/s",
            "met SLO",
        ),
        title_justify="left",
    )
    groups = {
        "overall": summary["overall"],
        **{f"class {k}": v for k, v in summary["by_class"].items()},
    }
    for name, g in groups.items():
        th, gp, rq = g["throughput"], g["goodput"], g["requests"]
        frac = gp["fraction"]
        t.add_row(
            name,
            str(rq["sent"]),
            str(rq["failed"]),
            _num(th["requests_per_s"]),
            _num(th["input_tokens_per_s"]),
            _out_rate(th),
            _num(gp["requests_per_s"]),
            "-" if frac is None else f"{frac:.0%}",
        )
    return t


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:,.2f}"


def _out_rate(th: dict[str, Any]) -> str:
    """Output tokens/s of successful requests, with what failed requests streamed beside it."""
    failed = th.get("failed_output_tokens_per_s")
    extra = f" (+{failed:,.2f} failed)" if failed else ""
    return _num(th["output_tokens_per_s"]) + extra


def stages_table(stages: list[tuple[str | None, dict[str, Any] | None, bool]]) -> Table:
    """One row per load stage: ``(label, summarize body, whether the client kept up)``."""
    t = _figures_table(
        "stages",
        "stage",
        (
            "sent",
            "failed",
            "req/s",
            "out tok/s",
            "TTFT p50",
            "TTFT p99",
            "ITL p50",
            "ITL p99",
            "met SLO",
            "steady",
            "client",
        ),
        title_justify="left",
    )
    for label, m, valid in stages:
        assert m is not None
        o = m["overall"]
        lat = o["latency"]

        def ms(metric: str, p: str, lat: dict[str, Any] = lat) -> str:
            v = lat[metric][p]
            return "-" if v is None else f"{_ms0(v)} ms"

        frac = o["goodput"]["fraction"]
        t.add_row(
            label or "-",
            str(o["requests"]["sent"]),
            str(o["requests"]["failed"]),
            f"{o['throughput']['requests_per_s'] or 0:.2f}",
            f"{o['throughput']['output_tokens_per_s'] or 0:.1f}",
            ms("ttft", "p50"),
            ms("ttft", "p99"),
            ms("itl", "p50"),
            ms("itl", "p99"),
            "-" if frac is None else f"{frac:.0%}",
            {"steady": "yes", "over_saturated": "[red]NO[/red]"}.get(
                _saturation(m).get("state", ""), "?"
            ),
            "ok" if valid else "[red]INVALID[/red]",
        )
    return t


def sim_table(rows: list[dict[str, Any]]) -> Table:
    """One column per simulated configuration, one row per metric (fits a terminal)."""
    table = Table(title="servelab sim (simulated)")
    table.add_column("metric")
    for row in rows:
        table.add_column(row["label"], justify="right", overflow="fold")
    for c in [k for k in rows[0] if k != "label"]:
        cells = []
        for row in rows:
            v = row[c]
            if v is None:
                cells.append("-")
            elif isinstance(v, float):
                cells.append(
                    f"{fmt_ms(v)} ms" if c.startswith(("ttft", "itl", "e2e")) else f"{v:.4g}"
                )
            else:
                cells.append(str(v))
        table.add_row(c, *cells)
    return table


def defaults_line(used: dict[str, Any], info: dict[str, Any]) -> str:
    """One line naming the simulated engine's defaults, what overrode them, and the dtypes."""
    cfg = used["config"]
    shown = ", ".join(f"{k}={v}" for k, v in cfg.items())
    over = used.get("overridden") or []
    prec = info.get("precision", {})
    return (
        f"engine defaults: {used['engine']} on {info.get('hardware')} ({used['hardware_class']}): "
        f"{shown}, gpu_memory_utilization={info.get('gpu_memory_utilization')}"
        + (f"; overridden by --engine-args: {', '.join(over)}" if over else "")
        + (f"; dtype {prec['dtype']}, kv {prec['kv_dtype']}" if prec else "")
        + f" [{used['source']}]"
    )


_ANSWER_STYLE = {"significant": "green", "noise": "yellow"}


def render_answers(answers: list[Answer], console: Console) -> None:
    """The demo's last word: each question and its answer in one sentence."""
    console.rule("[bold]the answers")
    for a in answers:
        style = _ANSWER_STYLE[a.verdict]
        console.print(f"[bold]{a.question.id}[/] [{style}]({a.verdict})[/]: {a.answer}")


def run_line(label: str, run: Run | None, code: int) -> str:
    """One sub-run of a job in one line: its label, requests, time, TTFT and ITL medians
    (E2E where nothing streamed), and INVALID with the reason where the run was invalid."""
    if run is None:
        return f"{label:<29} [red]no request finished[/] (exit {code})"
    s = run_summary(run)
    o = s["overall"]
    lat = o["latency"]
    n = o["requests"]
    head = f"{label:<29}{n['ok']:>3}/{n['sent']:<3}{s['window']['duration_s']:6.1f} s"
    if lat["ttft"].get("p50") is not None:
        head += f"  TTFT p50 {fmt_ms(lat['ttft']['p50'], 0)} ms"
        if lat["itl"].get("p50") is not None:
            head += f"  ITL p50 {fmt_ms(lat['itl']['p50'], 0)} ms"
    elif lat["e2e"].get("p50") is not None:
        head += f"  E2E p50 {fmt_ms(lat['e2e']['p50'], 0)} ms"
    if not run.valid:
        head += f"  [bold red]INVALID[/]: {run.manifest.get('invalid_reason')}"
    return head
