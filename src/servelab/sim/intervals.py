"""A prediction with intervals: one scenario simulated under several simulator seeds.

Each seed draws its own step noise (and, for a twin, prices steps with its own bootstrap
refit: ``TwinCalibration.target``), so the figures' spread over seeds is how far one real
run of that load could land from the typical one, as far as the simulator knows. The
prediction is the median over seeds and the interval the range (lowest to highest): with
``n`` seeds a further draw falls inside it with probability ``(n - 1) / (n + 1)``.

That range is the simulator's own spread. A twin fitted to several runs also states how far
its replays missed the figures of runs it was not fitted on (``sim.fit.held_out``): the
half-widths (level -> h, in log space) put a figure's 80% and 95% intervals at
``median * exp(+-h)``, each figure's own where the twin has one (``figure_widths``), else
the pooled ``half_widths``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from servelab.analyze.summary import measured_window, summarize_group
from servelab.sim.scenario import Scenario, simulate
from servelab.vocab import ClientRecord

# (name, latency metric, statistic): the figures a prediction reports; the statistic is one
# of ``metrics.json``'s (p50, p90, p99, mean), None for the output throughput. New figures
# go at the end: readers of prediction.json key on the names.
FIGURES: tuple[tuple[str, str | None, str | None], ...] = (
    ("ttft_p50", "ttft", "p50"),
    ("ttft_p90", "ttft", "p90"),
    ("itl_p50", "itl", "p50"),
    ("itl_p99", "itl", "p99"),
    ("tpot_p50", "tpot", "p50"),
    ("output_tok_s", None, None),
    ("ttft_mean", "ttft", "mean"),
    ("ttft_p99", "ttft", "p99"),
    ("e2e_mean", "e2e", "mean"),
    ("e2e_p99", "e2e", "p99"),
)


def figures_of(records: Sequence[ClientRecord]) -> dict[str, float | None]:
    """The ``FIGURES`` of a set of records over their measured window (as ``metrics.json``'s
    ``overall`` has them, without confidence intervals)."""
    group = summarize_group(records, measured_window(records), None, n_boot=0)
    out: dict[str, float | None] = {}
    for name, metric, pct in FIGURES:
        if metric is None:
            out[name] = group["throughput"]["output_tokens_per_s"]
        else:
            out[name] = group["latency"][metric][pct]
    return out


def measured_figures(metrics: dict[str, Any]) -> dict[str, float | None]:
    """The ``FIGURES`` of a run's ``metrics.json`` (its ``overall``; None where it has none):
    what a prediction of that run is judged against."""
    o = metrics.get("overall") or {}
    out: dict[str, float | None] = {}
    for name, metric, stat in FIGURES:
        if metric is None:
            out[name] = o.get("throughput", {}).get("output_tokens_per_s")
        else:
            out[name] = o.get("latency", {}).get(metric, {}).get(stat)
    return out


@dataclass
class FigureRanges:
    """Per-seed figures and, per figure, the median and the range over seeds, and where
    half-widths are given (level, e.g. ``"80"``, -> log half-width) the intervals at each
    level around the median: ``figure_widths[name]`` where the figure has its own, else
    the pooled ``half_widths``."""

    seeds: list[int]
    per_seed: list[dict[str, float | None]] = field(default_factory=list)
    half_widths: dict[str, float] = field(default_factory=dict)
    figure_widths: dict[str, dict[str, float]] = field(default_factory=dict)

    def _values(self, name: str) -> list[float]:
        return [v for f in self.per_seed if (v := f.get(name)) is not None]

    def median(self, name: str) -> float | None:
        vals = self._values(name)
        return statistics.median(vals) if vals else None

    def interval(self, name: str) -> tuple[float, float] | None:
        vals = self._values(name)
        return (min(vals), max(vals)) if vals else None

    def widths(self, name: str) -> dict[str, float]:
        """Level -> the half-width ``name``'s intervals use: its own, else the pooled."""
        return self.figure_widths.get(name) or self.half_widths

    def levels(self, name: str) -> dict[str, tuple[float, float]]:
        """Level -> (low, high): the median times ``exp(-h)`` and ``exp(h)``."""
        m = self.median(name)
        if m is None:
            return {}
        return {lvl: (m * math.exp(-h), m * math.exp(h)) for lvl, h in self.widths(name).items()}

    def to_dict(self) -> dict[str, Any]:
        figures: dict[str, Any] = {}
        for name, _, _ in FIGURES:
            figures[name] = {"median": self.median(name), "interval": self.interval(name)}
            if self.widths(name):
                figures[name]["intervals"] = self.levels(name)
                # readers judge the levels alone; which width they came from sits beside them
                figures[name]["intervals_from"] = (
                    "figure" if name in self.figure_widths else "pooled"
                )
        return {
            "seeds": self.seeds,
            "figures": figures,
            "per_seed": self.per_seed,
            **({"half_widths": self.half_widths} if self.half_widths else {}),
            **({"figure_half_widths": self.figure_widths} if self.figure_widths else {}),
        }


def predict(
    scenario_for: Callable[[int], Scenario],
    seeds: Sequence[int],
    first: Any = None,
    half_widths: dict[str, float] | None = None,
    figure_widths: dict[str, dict[str, float]] | None = None,
) -> FigureRanges:
    """Simulate ``scenario_for(seed)`` for every seed. ``first``: the records of a run
    already simulated for ``seeds[0]`` (the one written to disk), reused as is;
    ``half_widths``, ``figure_widths``: the target's stated intervals (``FigureRanges``)."""
    pred = FigureRanges(
        list(seeds), half_widths=dict(half_widths or {}), figure_widths=dict(figure_widths or {})
    )
    for k, seed in enumerate(seeds):
        if k == 0 and first is not None:
            recs = first
        else:
            recs = simulate(scenario_for(seed), keep_steps=False).records
        pred.per_seed.append(figures_of(recs))
    return pred
