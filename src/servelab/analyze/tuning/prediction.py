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
interval is the range over the seeds. :func:`self_check` compares, in each held-out part of
a run, the replay of its requests by a model fitted to the rest of the run with their
measured figures (module constant ``TOLERANCE``) and their confidence intervals.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from statistics import NormalDist
from typing import Any

from servelab.analyze.stats import DEFAULT_CONFIDENCE, describe
from servelab.analyze.summary import measured_window, metric_values, summarize_group
from servelab.analyze.tuning.gates import TAIL_REQUESTS
from servelab.units import SLO
from servelab.vocab import ClientRecord

# The self-check's tolerance: the replay's figure (median over seeds) may differ from the
# measured one by this share of it. ``servelab tune --tolerance`` changes it.
TOLERANCE = 0.15
# The figures the self-check compares, per scope (overall and each class).
CHECKED = ("ttft_p50", "ttft_p95", "itl_p50", "itl_p99", "tpot_p50", "e2e_p95", "output_tok_s")
# ... and where the run has SLOs, what they decide (the objective's and each candidate's
# target figure are checked too).
SLO_FIGURES = ("goodput", "attainment")
# A mean, a maximum or a rate of fewer values than this is not pinned down by a run (for
# goodput and attainment the values are the requests that met their SLOs: a share of 1 in
# 56 is one request, and the next one doubles it); a percentile needs ``TAIL_REQUESTS``
# values beyond its quantile (the tune gates' rule).
MIN_VALUES = 10
# The verdicts of a figure the run cannot check: a decision resting on one is not made.
UNCHECKED = ("too_small", "unsettled", "unmeasured")
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


def value_text(name: str, x: float | None) -> str:
    """A figure in the unit people read: ms for latencies."""
    if x is None:
        return "-"
    if is_latency(name):
        return f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.3g} s"
    if name == "attainment":
        return f"{x:.0%}"
    return f"{x:.3g}"


def interval_text(name: str, lo: float, hi: float) -> str:
    """``lo-hi`` in one unit, the upper bound's: ``"410-520 ms"``, ``"0.41-1.2 s"``."""
    if is_latency(name):
        if hi < 1:
            return f"{lo * 1e3:.0f}-{hi * 1e3:.0f} ms"
        return f"{lo:.3g}-{hi:.3g} s"
    if name == "attainment":
        return f"{lo:.0%}-{hi:.0%}"
    return f"{lo:.3g}-{hi:.3g}"


@dataclass
class FigureSet:
    """A run's figures, their confidence intervals (where bootstrapped), and how many
    values each latency metric had per scope (``counts[scope][metric]``: requests, or
    token gaps for ITL; ``counts[scope]["requests"]``: the requests sent)."""

    values: Figures
    ci: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)

    def count(self, scope: str, name: str) -> int:
        """The values behind a figure: a latency metric's values, else the requests."""
        if is_latency(name):
            key = split_name(name)[0]
        else:
            key = "met" if name in SLO_FIGURES else "requests"
        return self.counts.get(scope, {}).get(key, 0)


def wilson(k: int, n: int, confidence: float = DEFAULT_CONFIDENCE) -> tuple[float, float]:
    """The Wilson score interval of a share of ``k`` in ``n`` (``n`` > 0): unlike the normal
    one it stays within 0-1 and is not zero-wide at 0 or ``n``."""
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p, zz = k / n, z * z / n
    mid = (p + zz / 2) / (1 + zz)
    half = z / (1 + zz) * math.sqrt(p * (1 - p) / n + zz / (4 * n))
    return max(0.0, mid - half), min(1.0, mid + half)


def figures(
    records: Sequence[ClientRecord],
    slos: dict[str, SLO] | SLO | None = None,
    n_boot: int = 0,
    seed: int = 0,
) -> FigureSet:
    """Every figure per scope over ``records``; with ``n_boot`` > 0, their 95% confidence
    intervals: a bootstrap of the latency figures (requests resampled whole, no interval
    for a maximum), the Wilson interval of SLO attainment (the share of the requests sent
    that met their SLOs), and goodput as completions/s times the Wilson interval of the
    share of completions that met them (the requests sent, hence completions/s, are the
    run's own load, which a replay sends alike; whether each met its SLOs is what varies).
    Output tokens/s and completions/s carry none: they sum every token or completion of
    the window, and their spread over requests is not a sampling error of the same kind."""
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
        if n_boot > 0:
            cis.update(_share_cis(s, window.duration))
        counts["requests"] = len(recs)
        share = vals["attainment"]
        counts["met"] = round(share * len(recs)) if share is not None else 0
        out.values[scope] = vals
        out.ci[scope] = cis
        out.counts[scope] = counts
    return out


def _share_cis(s: dict[str, Any], duration: float) -> dict[str, tuple[float, float]]:
    """The Wilson intervals of attainment and goodput of one ``summarize_group`` result."""
    out = {}
    sent, met = s["requests"]["sent"], s["goodput"]["met"]
    if sent:
        out["attainment"] = wilson(met, sent)
    rate, good = s["throughput"]["requests_per_s"], s["goodput"]["requests_per_s"]
    if rate and good is not None and duration > 0:
        done = round(rate * duration)
        lo, hi = wilson(round(good * duration), done)
        out["goodput"] = (rate * lo, rate * hi)
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
    """``(predicted - measured) / measured``; 0 where both are 0, None where only the
    measured one is (no share of nothing) or either is missing."""
    if predicted is None or measured is None:
        return None
    if measured == 0:
        return 0.0 if predicted == 0 else None
    return (predicted - measured) / measured


@dataclass(frozen=True)
class CheckRow:
    """One figure of the self-check, over every held-out part of the run: the part where
    the replay is furthest off (or, for ``too_small``, the one with the fewest values).
    ``verdict``: ``ok`` (within the tolerance in every part), ``strayed`` (beyond it and
    outside the measured figure's confidence interval in a part that pins the figure
    down), ``unsettled`` (beyond the tolerance only inside that interval: the part's own
    noise is as large as the error), ``too_small`` (a part has fewer than ``needed``
    values behind it: ``n``) or ``unmeasured``. ``in_ci``: whether the replay's median lies in ``measured_ci`` (None:
    no interval or no replay)."""

    scope: str
    name: str
    measured: float | None
    measured_ci: tuple[float, float] | None
    replay: Spread | None
    error: float | None
    verdict: str
    n: int = 0
    needed: int = 0
    part: int = 0

    @property
    def in_ci(self) -> bool | None:
        if self.measured_ci is None or self.replay is None:
            return None
        lo, hi = self.measured_ci
        return lo <= self.replay.median <= hi

    @property
    def off_by(self) -> str:
        """How far off the replay is and against what: ``"+36%, outside the measured 95%
        CI 410-520 ms, held-out part 2"``."""
        err = "-" if self.error is None else f"{self.error:+.0%}"
        if self.measured_ci is None:
            against = "no measured CI"
        else:
            where = "inside" if self.in_ci else "outside"
            ci = interval_text(self.name, *self.measured_ci)
            against = f"{where} the measured {DEFAULT_CONFIDENCE:.0%} CI {ci}"
        return f"{err}, {against}, held-out part {self.part + 1}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "scope": self.scope,
            "figure": self.name,
            "measured": self.measured,
            "measured_ci": self.measured_ci,
            "ci_confidence": DEFAULT_CONFIDENCE,
            "in_ci": self.in_ci,
            "replay": self.replay.to_dict() if self.replay else None,
            "error": self.error,
            "verdict": self.verdict,
            "values": self.n,
            "needed": self.needed,
            "part": self.part,
        }

    @property
    def shortfall(self) -> str:
        """What the run lacks to check this figure (``too_small``)."""
        what = "token gaps" if self.name.startswith("itl_") else "requests"
        if self.name in SLO_FIGURES:
            what = "requests that met their SLOs"
        where = "overall" if self.scope == "overall" else f"of class {self.scope}"
        return (
            f"{label(self.name)} rests on {self.n} {what} {where} in a held-out part, "
            f"needs {self.needed}"
        )


@dataclass
class SelfCheck:
    tolerance: float
    rows: list[CheckRow]
    parts: int = 1

    @property
    def strayed(self) -> list[CheckRow]:
        return [r for r in self.rows if r.verdict == "strayed"]

    @property
    def ok(self) -> bool:
        return not self.strayed and any(r.verdict == "ok" for r in self.rows)

    def too_small(self, scope: str, name: str) -> str | None:
        """Why the run is too small to decide ``name`` of ``scope`` (None: it is not)."""
        for r in self.rows:
            if (r.scope, r.name) == (scope, name) and r.verdict in UNCHECKED:
                if r.verdict == "unsettled":
                    return (
                        f"the run is too noisy for this decision: {label(name)} of {scope} "
                        f"replayed {r.off_by}: no model error beyond the part's own noise "
                        "is shown, nor ruled out"
                    )
                if r.verdict == "unmeasured":
                    return (
                        f"{label(name)} of {scope} cannot be checked: held-out part "
                        f"{r.part + 1} measured {r.measured if r.measured is not None else 'none'}"
                        f" and the replay {r.replay.median if r.replay else 'none'}"
                    )
                return f"the run is too small for this decision: {r.shortfall}"
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "tolerance": self.tolerance,
            "parts": self.parts,
            "ok": self.ok,
            "strayed": [f"{r.scope} {r.name}" for r in self.strayed],
            "too_small": [f"{r.scope} {r.name}" for r in self.rows if r.verdict == "too_small"],
            "unsettled": [f"{r.scope} {r.name}" for r in self.rows if r.verdict == "unsettled"],
            "rows": [r.to_dict() for r in self.rows],
        }


def needed(name: str) -> int:
    """Values a figure needs behind it to be pinned down: ``MIN_VALUES``, and for a
    percentile ``TAIL_REQUESTS`` beyond its quantile (p95: 100; with fewer, a p95 is one of
    the largest few values, whatever the server would do on the next ones)."""
    if is_latency(name):
        stat = split_name(name)[1]
        if stat.startswith("p"):
            q = int(stat[1:]) / 100
            return max(MIN_VALUES, math.ceil(TAIL_REQUESTS / (1 - q) - 1e-9))
    return MIN_VALUES


def self_check(
    parts: Sequence[tuple[FigureSet, Prediction]],
    tolerance: float = TOLERANCE,
    names: Sequence[str] = CHECKED,
) -> SelfCheck:
    """Each of ``names`` of each scope, in each held-out part of the run (its measured
    figures, and the replay of the same requests by a model that did not see them): the
    replay's median over seeds against the measured figure. It strays when it is off by
    more than ``tolerance`` of the measured figure and outside the measured figure's
    confidence interval (``FigureSet.ci``; a figure without one strays on the tolerance
    alone) in a part with ``needed`` values behind it: a part's own sampling noise says
    how far its figure is from the server's, and an error within it is not shown to be the
    model's. Off by more than ``tolerance`` but inside the interval, it is ``unsettled``:
    the run can neither blame nor clear the model, so it is not passed. A part with fewer
    values makes it ``too_small``, never passed either: the run cannot check it."""
    if not 0 < tolerance < 1:
        raise ValueError(f"the self-check tolerance must be between 0 and 1, got {tolerance}")
    scopes: dict[str, None] = {}
    for measured, _ in parts:
        scopes.update(dict.fromkeys(measured.values))
    rows = []
    for scope in scopes:
        for name in names:
            need = needed(name)
            each = []
            for i, (measured, replay) in enumerate(parts):
                m = measured.values.get(scope, {}).get(name)
                rep = replay.spread(scope, name)
                err = rel_error(rep.median if rep else None, m)
                n = measured.count(scope, name)
                ci = measured.ci.get(scope, {}).get(name)
                each.append(CheckRow(scope, name, m, ci, rep, err, "", n, need, i))
            pinned = [r for r in each if r.n >= need]
            beyond = [r for r in pinned if r.error is not None and abs(r.error) > tolerance]
            off = [r for r in beyond if r.in_ci is not True]
            if off:
                worst, verdict = max(off, key=lambda r: abs(r.error or 0.0)), "strayed"
            elif len(pinned) < len(each):
                worst, verdict = min(each, key=lambda r: r.n), "too_small"
            elif beyond:
                worst, verdict = max(beyond, key=lambda r: abs(r.error or 0.0)), "unsettled"
            elif any(r.error is None for r in each):
                worst, verdict = next(r for r in each if r.error is None), "unmeasured"
            else:
                worst, verdict = max(each, key=lambda r: abs(r.error or 0.0)), "ok"
            rows.append(replace(worst, verdict=verdict))
    return SelfCheck(tolerance, rows, len(parts))
