"""Predicted against measured: a tuned setting and the as-run config, rerun for real.

Both configurations ran the same planned requests (repeats, alternating order). Per
configuration and figure: the prediction (median and range over simulator seeds) and the
measurement (the mean over the repeats of each run's figure, and their range), the
prediction's error and whether the measurement fell inside the predicted range. The
candidate's target figure is tested as the demo tests its key metric
(``answers.measure``: a two-sided permutation test relabelling whole requests), and SLO
attainment by the same test on each request's met/missed outcome.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from servelab.analyze.answers import Measured, measure
from servelab.analyze.compare import DEFAULT_ALPHA, permutation_pvalues
from servelab.analyze.tuning.prediction import (
    CHECKED,
    HIGHER_IS_BETTER,
    Prediction,
    Spread,
    figures,
    label,
    rel_error,
    split_name,
)
from servelab.rundir import Run
from servelab.units import SLO

AS_RUN = "as-run"
TUNED = "tuned"


@dataclass(frozen=True)
class VerifyRow:
    config: str  # AS_RUN | TUNED
    scope: str
    name: str
    predicted: Spread | None
    measured: float | None
    measured_range: tuple[float, float] | None
    error: float | None

    @property
    def inside(self) -> bool | None:
        """Whether the measurement lies in the predicted range over seeds."""
        if self.predicted is None or self.measured is None:
            return None
        return self.predicted.lo <= self.measured <= self.predicted.hi

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "scope": self.scope,
            "figure": self.name,
            "predicted": self.predicted.to_dict() if self.predicted else None,
            "measured": self.measured,
            "measured_range": self.measured_range,
            "error": self.error,
            "inside_predicted_range": self.inside,
        }


@dataclass
class Verification:
    """``key`` tests the candidate's target figure, ``attainment_p`` SLO attainment
    (None: no SLOs or too few requests). ``key_error`` is the tuned prediction's error on
    the target figure; ``key_error_adjusted`` that of the predicted change applied to the
    as-run arm's measurement (``_adjusted_error``)."""

    repeats: int
    rows: list[VerifyRow]
    target: tuple[str, str]
    key: Measured
    attainment: tuple[float | None, float | None]  # measured as-run, tuned
    attainment_p: float | None
    key_error: float | None
    key_error_adjusted: float | None
    verdict: str  # "better" | "worse" | "noise"
    sentence: str
    alpha: float = DEFAULT_ALPHA

    def to_dict(self) -> dict[str, Any]:
        k = self.key
        return {
            "repeats": self.repeats,
            "target": list(self.target),
            "key": {
                "as_run": k.baseline_value,
                "tuned": k.treatment_value,
                "as_run_ci": k.baseline_ci,
                "tuned_ci": k.treatment_ci,
                "delta": k.delta,
                "p_value": k.p_value,
            },
            "attainment": list(self.attainment),
            "attainment_p": self.attainment_p,
            "key_prediction_error": self.key_error,
            "key_prediction_error_drift_adjusted": self.key_error_adjusted,
            "verdict": self.verdict,
            "sentence": self.sentence,
            "alpha": self.alpha,
            "rows": [r.to_dict() for r in self.rows],
        }


def _measured(
    runs: Sequence[Run], slos: dict[str, SLO]
) -> list[dict[str, dict[str, float | None]]]:
    return [figures(r.records, slos).values for r in runs]


def _mean_range(
    per_run: list[dict[str, dict[str, float | None]]], scope: str, name: str
) -> tuple[float | None, tuple[float, float] | None]:
    vals = [v for f in per_run if (v := f.get(scope, {}).get(name)) is not None]
    if not vals:
        return None, None
    return statistics.fmean(vals), (min(vals), max(vals))


def _met(runs: Sequence[Run], slos: dict[str, SLO]) -> list[float]:
    return [
        1.0 if r.ok and slos.get(r.workload_class, SLO()).met(r) else 0.0
        for run in runs
        for r in run.records
    ]


def verify(
    predicted: dict[str, Prediction],
    runs: dict[str, list[Run]],
    target: tuple[str, str],
    slos: dict[str, SLO],
    alpha: float = DEFAULT_ALPHA,
    names: Sequence[str] = (*CHECKED, "attainment", "goodput"),
) -> Verification:
    """``predicted`` and ``runs`` are keyed by ``AS_RUN`` and ``TUNED``."""
    names = tuple(dict.fromkeys((*names, target[1])))
    rows: list[VerifyRow] = []
    for config in (AS_RUN, TUNED):
        per_run = _measured(runs[config], slos)
        scopes = list(dict.fromkeys(s for f in per_run for s in f))
        for scope in scopes:
            for name in names:
                m, rng = _mean_range(per_run, scope, name)
                p = predicted[config].spread(scope, name)
                rows.append(
                    VerifyRow(config, scope, name, p, m, rng, rel_error(p.median if p else None, m))
                )
    scope, name = target
    metric, stat = split_name(name)
    key = measure(runs[AS_RUN], runs[TUNED], (scope, metric, stat))
    by = {(r.config, r.scope, r.name): r for r in rows}
    key_row = by.get((TUNED, scope, name))
    key_adjusted = _adjusted_error(by.get((AS_RUN, scope, name)), key_row)
    att_p = None
    attainment: tuple[float | None, float | None] = (None, None)
    if slos:
        a, b = _met(runs[AS_RUN], slos), _met(runs[TUNED], slos)
        attainment = (statistics.fmean(a) if a else None, statistics.fmean(b) if b else None)
        att_p = permutation_pvalues((a, None), (b, None)).get("mean")
    verdict = "noise"
    if key.p_value is not None and key.p_value <= alpha and key.delta is not None:
        better = key.delta > 0 if name in HIGHER_IS_BETTER else key.delta < 0
        verdict = "better" if better else "worse"
    where = "" if scope == "overall" else f" of {scope}"
    p_txt = "untested" if key.p_value is None else f"p = {key.p_value:.3g}"
    sentence = (
        f"{label(name)}{where}: {_v(name, key.treatment_value)} tuned vs "
        f"{_v(name, key.baseline_value)} as run ({_signed(key.delta)}, {verdict}, {p_txt}); "
        f"predicted {_v(name, key_row.predicted.median if key_row and key_row.predicted else None)}"
        f" ({_signed(key_row.error if key_row else None)} from the measurement; "
        f"{_signed(key_adjusted)} as a change from the as-run arm)."
    )
    if att_p is not None:
        sentence += (
            f" SLO attainment {_frac(attainment[1])} tuned vs {_frac(attainment[0])}"
            f" as run (p = {att_p:.3g})."
        )
    return Verification(
        repeats=len(runs[TUNED]),
        rows=rows,
        target=target,
        key=key,
        attainment=attainment,
        attainment_p=att_p,
        key_error=key_row.error if key_row else None,
        key_error_adjusted=key_adjusted,
        verdict=verdict,
        sentence=sentence,
        alpha=alpha,
    )


def _adjusted_error(as_run: VerifyRow | None, tuned: VerifyRow | None) -> float | None:
    """The error of ``measured as run x predicted tuned / predicted as run`` against the
    tuned measurement. The verification runs minutes or hours after the run the cost model
    was fitted to, and this machine's speed drifts by 10-20% over minutes
    (docs/design/sim.md): the as-run arm, measured beside the tuned one, carries that drift,
    so the predicted change applied to it is the prediction for the machine as it is now."""
    if as_run is None or tuned is None or as_run.predicted is None or tuned.predicted is None:
        return None
    if as_run.measured is None or not as_run.predicted.median:
        return None
    adjusted = as_run.measured * tuned.predicted.median / as_run.predicted.median
    return rel_error(adjusted, tuned.measured)


def _v(name: str, x: float | None) -> str:
    if x is None:
        return "-"
    if name in HIGHER_IS_BETTER:
        return f"{x:.1%}" if name == "attainment" else f"{x:.3g}"
    return f"{x * 1e3:.0f} ms"


def _signed(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _frac(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"
