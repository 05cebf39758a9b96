"""How the time windows and the sending span's rates read, in the terminal and the HTML report.

Window edges are seconds from the start of the measured window, printed to at most two
decimals (``0-5.5``, not ``0-5.50339``). The offered and achieved rates are taken over the
sending span (``analyze.timeslices``); when that span is shorter than one window and nothing
completed in it (a closed loop sends its whole first wave at once), the pair would read as
"offered 1.51e+04 req/s, achieved 0 req/s", so the span is described instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def seconds_text(x: float) -> str:
    """``5.50339`` -> ``"5.5"``, ``10.0`` -> ``"10"``."""
    return f"{x:.2f}".rstrip("0").rstrip(".")


def window_label(w: dict[str, Any]) -> str:
    """A time window's ``start-end`` in seconds."""
    return f"{seconds_text(w['start'])}-{seconds_text(w['end'])}"


def rates_text(ts: dict[str, Any], num: Callable[[float | None], str]) -> str:
    """``"offered X req/s, achieved Y req/s"`` over the sending span, or why there are none."""
    if ts["offered_rate"] is None:
        return "no sending span"
    slices = ts["slices"]
    span = slices[-1]["end"] if slices else 0.0
    if span < ts["slice_duration_s"] and not ts["achieved_rate"]:
        sent = sum(w["sent"] for w in slices)
        return (
            f"all {sent} requests were sent within {seconds_text(span) if span >= 0.01 else '0.01'} s, "
            "before any completed: no offered or achieved rate"
        )
    return f"offered {num(ts['offered_rate'])} req/s, achieved {num(ts['achieved_rate'])} req/s"
