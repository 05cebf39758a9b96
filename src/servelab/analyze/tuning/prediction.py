"""Figures of a run per class, their spread over simulator seeds, and the replay's self-check.

A *figure* is one number of one scope (``overall`` or a workload class): a latency
statistic ``<metric>_<stat>`` (TTFT, ITL, TPOT, E2E and each request's longest ITL,
``max_itl``; p50/p90/p95/p99/mean/max), output tokens/s (``output_tok_s``), completions/s
(``requests_s``), SLO attainment (``attainment``, the fraction of requests sent that met
every SLO of their class) and goodput (``goodput``, completions/s that met them). All come
from ``summary.summarize_group`` over the records' own window (first send to last byte), so
a run and its simulation are measured alike.

A :class:`Prediction` holds the figures of one configuration simulated under several
simulator seeds (each seed draws its own step noise and speculative acceptance): its
interval is the range over the seeds. :func:`self_check` compares the replay of a run as
it ran with the run's measured figures (module constant ``TOLERANCE``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from servelab.analyze.stats import describe
from servelab.analyze.summary import measured_window, metric_values, summarize_group
from servelab.units import SLO
from servelab.vocab import ClientRecord

# The self-check's tolerance: the replay's figure (median over seeds) may differ from the
# measured one by this share of it. ``servelab tune --tolerance`` changes it.
TOLERANCE = 0.15
# The figures the self-check compares, per scope (overall and each class).
CHECKED = ("ttft_p50", "ttft_p95", "itl_p50", "itl_p99", "tpot_p50", "e2e_p95", "output_tok_s")
METRICS = ("ttft", "itl", "tpot", "e2e", "max_itl")
STATS = ("p50", "p90", "p95", "p99", "mean", "max")
RATES = {
    "output_tok_s": ("throughput", "output_tokens_per_s"),
    "requests_s": ("throughput", "requests_per_s"),
    "goodput": ("goodput", "requests_per_s"),
    "attainment": ("goodput", "fraction"),
}
HIGHER_IS_BETTER = frozenset(RATES)
LABELS = {
    "output_tok_s": "output tok/s",
    "requests_s": "completions/s",
    "goodput": "goodput req/s",
    "attainment": "SLO attainment",
}

# scope -> figure name -> value (None: no request gave one)
Figures = dict[str, dict[str, float | None]]


def figure_names() -> list[str]:
    return [f"{m}_{s}" for m in METRICS for s in STATS] + list(RATES)


def split_name(name: str) -> tuple[str, str]:
    """``"ttft_p95"`` -> ``("ttft", "p95")``; a rate -> its ``summarize_group`` section and key."""
    if name in RATES:
        return RATES[name]
    metric, _, stat = name.rpartition("_")
    if metric not in METRICS or stat not in STATS:
        raise ValueError(
            f"unknown figure {name!r}: use <metric>_<stat> with metric one of "
            f"{', '.join(METRICS)} and stat one of {', '.join(STATS)}, or one of "
            f"{', '.join(RATES)}"
        )
    return metric, stat


def label(name: str) -> str:
    if name in LABELS:
        return LABELS[name]
    metric, stat = split_name(name)
    return f"{'longest ITL' if metric == 'max_itl' else metric.upper()} {stat}"


def is_latency(name: str) -> bool:
    return name not in RATES


@dataclass
class FigureSet:
    """A run's figures, their confidence intervals (where bootstrapped), and how many
    values each latency metric had per scope (``counts[scope][metric]``: requests, or
    token gaps for ITL)."""

    values: Figures
    ci: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)

    def pinned(self, scope: str, name: str) -> bool:
        """Whether the run has values beyond the figure's quantile: a p95 of fewer than 20
        values is the largest one, whatever the server would do on the next 20."""
        if not is_latency(name):
            return True
        metric, stat = split_name(name)
        n = self.counts.get(scope, {}).get(metric, 0)
        if stat.startswith("p"):
            return n * (1 - int(stat[1:]) / 100) >= 1
        return n >= 2


def figures(
    records: Sequence[ClientRecord],
    slos: dict[str, SLO] | SLO | None = None,
    n_boot: int = 0,
    seed: int = 0,
) -> FigureSet:
    """Every figure per scope over ``records``; with ``n_boot`` > 0, bootstrap intervals of
    the latency figures (requests resampled whole)."""
    window = measured_window(records)
    groups: dict[str, list[ClientRecord]] = {"overall": list(records)}
    for r in records:
        groups.setdefault(r.workload_class, []).append(r)
    out = FigureSet({})
    for scope, recs in groups.items():
        s = summarize_group(recs, window, slos, n_boot=n_boot, seed=seed)
        vals: dict[str, float | None] = {}
        cis: dict[str, tuple[float, float]] = {}
        counts: dict[str, int] = {}
        lat = dict(s["latency"])
        ok = [r for r in recs if r.ok and window.contains(r.actual_send)]
        lat["max_itl"] = describe(*metric_values(ok, "max_itl"), n_boot=n_boot, seed=seed).to_dict()
        for m in METRICS:
            counts[m] = int(lat[m]["n"])
            for st in STATS:
                vals[f"{m}_{st}"] = lat[m][st]
                ci = lat[m].get("ci", {}).get(st)
                if ci:
                    cis[f"{m}_{st}"] = (float(ci[0]), float(ci[1]))
        for name, (section, key) in RATES.items():
            vals[name] = s[section][key]
        out.values[scope] = vals
        out.ci[scope] = cis
        out.counts[scope] = counts
    return out


@dataclass(frozen=True)
class Spread:
    """A figure over simulator seeds: the median and the range."""

    median: float
    lo: float
    hi: float
    n: int

    def to_dict(self) -> dict[str, float]:
        return {"median": self.median, "lo": self.lo, "hi": self.hi, "seeds": self.n}


@dataclass
class Prediction:
    """One configuration's figures under each simulator seed (``seeds[i]`` is seed i's)."""

    label: str
    seeds: list[Figures]
    durations: list[float] = field(default_factory=list)  # simulated seconds per seed

    def values(self, scope: str, name: str) -> list[float | None]:
        return [f.get(scope, {}).get(name) for f in self.seeds]

    def spread(self, scope: str, name: str) -> Spread | None:
        vals = [v for v in self.values(scope, name) if v is not None]
        if not vals:
            return None
        return Spread(statistics.median(vals), min(vals), max(vals), len(vals))

    @property
    def scopes(self) -> list[str]:
        seen: dict[str, None] = {}
        for f in self.seeds:
            seen.update(dict.fromkeys(f))
        return list(seen)

    def to_dict(self, names: Sequence[str] = CHECKED) -> dict[str, Any]:
        return {
            "label": self.label,
            "seeds": len(self.seeds),
            "figures": {
                scope: {n: s.to_dict() for n in names if (s := self.spread(scope, n))}
                for scope in self.scopes
            },
        }


def rel_error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured == 0:
        return None
    return (predicted - measured) / measured


@dataclass(frozen=True)
class CheckRow:
    """One figure of the self-check. ``verdict``: ``ok`` (within the tolerance), ``thin``
    (outside it, but inside the run's own 95% interval or beyond what its values can
    pin down: the run does not pin the figure down as tightly as the tolerance),
    ``strayed`` or ``unmeasured``."""

    scope: str
    name: str
    measured: float | None
    measured_ci: tuple[float, float] | None
    replay: Spread | None
    error: float | None
    verdict: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "scope": self.scope,
            "figure": self.name,
            "measured": self.measured,
            "measured_ci": self.measured_ci,
            "replay": self.replay.to_dict() if self.replay else None,
            "error": self.error,
            "verdict": self.verdict,
        }


@dataclass
class SelfCheck:
    tolerance: float
    rows: list[CheckRow]

    @property
    def strayed(self) -> list[CheckRow]:
        return [r for r in self.rows if r.verdict == "strayed"]

    @property
    def ok(self) -> bool:
        return not self.strayed and any(r.verdict == "ok" for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tolerance": self.tolerance,
            "ok": self.ok,
            "strayed": [f"{r.scope} {r.name}" for r in self.strayed],
            "rows": [r.to_dict() for r in self.rows],
        }


def self_check(
    measured: FigureSet,
    replay: Prediction,
    tolerance: float = TOLERANCE,
    names: Sequence[str] = CHECKED,
) -> SelfCheck:
    """Each checked figure of each scope: the replay's median over seeds against the
    measured figure. It strays when it is off by more than ``tolerance`` of the measured
    figure, lies outside the measured figure's 95% interval, and the run has values beyond
    the figure's quantile (``FigureSet.pinned``). A thin figure, which the run itself does
    not pin down to the tolerance, cannot refute the replay; it is shown as ``thin``."""
    if not 0 < tolerance < 1:
        raise ValueError(f"the self-check tolerance must be between 0 and 1, got {tolerance}")
    rows = []
    for scope, vals in measured.values.items():
        for name in names:
            m = vals.get(name)
            rep = replay.spread(scope, name)
            ci = measured.ci.get(scope, {}).get(name)
            err = rel_error(rep.median if rep else None, m)
            if err is None or rep is None:
                verdict = "unmeasured"
            elif abs(err) <= tolerance:
                verdict = "ok"
            elif (ci is not None and ci[0] <= rep.median <= ci[1]) or not measured.pinned(
                scope, name
            ):
                verdict = "thin"
            else:
                verdict = "strayed"
            rows.append(CheckRow(scope, name, m, ci, rep, err, verdict))
    return SelfCheck(tolerance, rows)
