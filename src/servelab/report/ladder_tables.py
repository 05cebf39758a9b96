"""Terminal tables of `servelab calibrate --plan`: the ladder it will run, and how the twin
fitted to it prices the prefill ladder's prompts against what they measured."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.table import Table

from servelab.units import fmt_ms


def ladder_table(rungs: Sequence[dict[str, Any]], note: str | None = None) -> Table:
    """The ladder, one row per rung (``workflows.calibration_plan.Rung`` as a dict)."""
    table = Table(title="calibration ladder" + (f" ({note})" if note else ""))
    for col in ("run", "requests", "streams", "prompt", "shared", "output"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for r in rungs:
        table.add_row(
            r["name"] + (" (not fitted)" if r["kind"] == "warmup" else ""),
            str(r["requests"]),
            str(r["concurrency"]),
            str(r["prompt"]),
            str(r["shared"] or "-"),
            str(r["output"]),
        )
    return table


def prefill_check_table(rows: Sequence[tuple[int, float | None, float, float]]) -> Table:
    """Each prefill rung as ``(prompt tokens, measured TTFT p50 s or None, the twin's TTFT s,
    the seconds of it priced on attention pairs)``."""
    table = Table(title="prompts alone: measured against the twin")
    for col in ("prompt", "TTFT p50", "twin", "error", "on attention"):
        table.add_column(col, justify="right")
    for n, measured, priced, attn in rows:
        err = f"{priced / measured - 1:+.0%}" if measured else "-"
        table.add_row(
            str(n),
            f"{fmt_ms(measured)} ms" if measured is not None else "-",
            f"{fmt_ms(priced)} ms",
            err,
            f"{fmt_ms(attn)} ms ({attn / priced:.0%})" if priced > 0 else "-",
        )
    return table
