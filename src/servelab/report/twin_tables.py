"""Terminal tables of a server's twin: its calibration, and predictions with their ranges."""

from __future__ import annotations

import math
from typing import Any

from rich.table import Table

from servelab.units import fmt_ms


def _figure(name: str, v: float | None) -> str:
    if v is None:
        return "-"
    return f"{fmt_ms(v)} ms" if name.startswith(("ttft", "itl", "tpot", "e2e")) else f"{v:.4g}"


def prediction_table(pred: Any, title: str) -> Table:
    """``sim.intervals.FigureRanges`` (or its ``to_dict()``): each figure's median and range,
    and where the twin states figures' own interval widths, each figure's 80% and 95%
    factors either side of the median and whether they are its own or the pooled ones."""
    doc = pred if isinstance(pred, dict) else pred.to_dict()
    table = Table(title=title)
    own = doc.get("figure_half_widths") or {}
    pooled = doc.get("half_widths") or {}
    cols = ("figure", "median", "range", *(("80% / 95%", "width") if own else ()))
    for col in cols:
        table.add_column(col, justify="left" if col in ("figure", "width") else "right")
    for name, f in doc["figures"].items():
        lo_hi = f.get("interval")
        rng = f"{_figure(name, lo_hi[0])} .. {_figure(name, lo_hi[1])}" if lo_hi else "-"
        row = [name, _figure(name, f.get("median")), rng]
        if own:
            h = own.get(name) or pooled
            row += [f"x{math.exp(h['80']):.2f} / x{math.exp(h['95']):.2f}",
                    "its own" if name in own else "pooled"]  # fmt: skip
        table.add_row(*row)
    return table


def calibration_table(cal: dict[str, Any]) -> Table:
    """A twin calibration (``TwinCalibration`` as a dict): settings with their sources, the
    fitted step cost, the API's time, the first step's share of a burst and the fit's error
    on the run it came from."""
    table = Table(title=f"twin of {cal['server']} serving {cal['model']}", show_header=False)
    table.add_column("what")
    table.add_column("value", overflow="fold")
    for k, v in cal["engine_config"].items():
        table.add_row(k, f"{v}  [dim]({cal['engine_sources'].get(k, '')})[/dim]")
    c = cal["cost"]
    table.add_row(
        "step cost",
        f"{c['step'] * 1e3:.2f} ms + {c['decode_seqs'] * 1e3:.3f} ms/decode + "
        f"{c['prefill_tokens'] * 1e6:.1f} us/prefill token + {c['kv_read'] * 1e9:.1f} ns/KV "
        f"token read + {c['attn_pairs'] * 1e12:.2f} ps/attention pair",
    )
    api = cal["fit"]["api_overhead"]
    table.add_row(
        "API time per request",
        f"{cal['api_overhead_s'] * 1e3:.1f} ms ({api['used']}; fitted "
        f"{api['fitted_s'] * 1e3:.1f} ms"
        + (
            f", reported {api['reported_median_s'] * 1e3:.1f} ms)"
            if api.get("reported_median_s") is not None
            else ")"
        ),
    )
    steps = cal.get("first_steps")
    if steps:
        by_length: dict[int, list[float]] = {}
        for tokens, share in steps:
            by_length.setdefault(round(tokens), []).append(share)
        shares = "; ".join(
            f"{'/'.join(f'{s:.0%}' for s in found)} at {tokens:.0f}"
            for tokens, found in sorted(by_length.items())
        )
        table.add_row(
            "first step of a burst",
            f"{shares} prompt tokens (of the requests sent at once to the idle server; the "
            "rest: the next step)",
        )
    err = cal["fit"]["error_on_training_steps"]
    inf = cal["fit"]["inference"]
    over = f"{err['steps']} steps" if "steps" in err else f"{err['windows']} request windows"
    table.add_row(
        "fit error (training run)"
        if cal["fit"].get("runs", 1) == 1
        else "fit error (training runs)",
        f"median {err['median']:.1%}, p90 {err['p90']:.1%} over {over}",
    )
    if "token_times" in cal["fit"]:  # fitted without every token's time
        table.add_row(
            "token times",
            "first and last only: fitted to each request's mean decode step and idle TTFT "
            f"({inf['decode_windows']} windows, {inf['idle_prefills']} idle prefills); no "
            "step noise, so ITL percentiles assume each step of a shape takes its price",
        )
        if inf.get("narrow_batch"):
            others = round(inf["batch_median"]) - 1
            beside = f"beside about {others} other{'s' * (others > 1)}" if others else "alone"
            table.add_row(
                "batch",
                f"[yellow]every request decoded {beside}[/yellow] (mean batch spans "
                f"{inf['batch_span']:.2f}x): the fit cannot tell a step's fixed cost from its "
                "cost per sequence; predictions at other concurrencies extrapolate (calibrate "
                "on runs at two or more concurrencies)",
            )
        return table
    table.add_row(
        "steps inferred",
        f"{inf['steps']} from {inf['requests']} streams (tolerance "
        f"{inf['tolerance_s'] * 1e3:.2f} ms; {inf['hidden_steps']} that streamed nothing; "
        f"{inf['coalesced_steps']} coalesced; mean batch {inf['mean_batch']:.2f})",
    )
    if "running_vs_batch_mean" in inf:
        srv, ours = inf["running_vs_batch_mean"]
        table.add_row(
            "check against /metrics", f"running {srv:.2f} (server) vs {ours:.2f} (inferred)"
        )
    return table
