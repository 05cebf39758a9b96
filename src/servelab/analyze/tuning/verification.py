"""Predicted against measured: the as-run config and the top candidates, rerun for real.

The arms are the as-run config (``AS_RUN``) and up to three settings the decision ranked,
the chosen one (``TUNED``) first. Every repeat runs fresh requests of the run's workload (a
plan seed of its own), the same requests for every arm of that repeat, so each arm is
paired with the as-run arm within a repeat and repeats are blocks.

Per arm and figure (the objective, and the arm's own target figure, its *key* figure):

- the **predicted change**: the median over simulator seeds of the paired relative change
  against the as-run config (``decision.paired_gains``), predicted on each repeat's own
  requests (``fresh``: the repeat's as-run run replayed with every arm's config) and
  averaged over repeats. The decision's prediction, on the run's requests, is kept beside it
  (``on_run``): the fresh requests are another draw of the run's load (an open loop's
  arrivals, another set of lengths), and a change near saturation grows with the load, so
  judging the model by its prediction for other requests than those measured would score the
  draw, not the model. Without ``fresh`` the run's prediction is the predicted change;
- the **measured change**: per repeat, the arm's figure against the as-run arm's on the same
  requests, relative; their mean over repeats;
- a two-sided **paired test** that never pools repeats of identical requests as independent
  samples. With enough repeats for a sign-flip test to reach ``alpha`` (2 / 2^R <= alpha: six
  at 0.05) it is the exact sign-flip permutation test on the per-repeat changes ("sign-flip
  over repeats"). With fewer it is a stratified permutation test ("matched requests,
  stratified by repeat"): within each repeat the two arms' records of one planned request
  (``planned_id``) swap arms or not at random, never across repeats, and the statistic
  is the mean over repeats of the per-repeat relative change, recomputed on each relabelling.

The **answer** is to apply the top-1 only where its measured objective gain is at least
``min_uplift`` and significant at ``alpha``; otherwise keep the config as run. The report
also says which arm was measured best (the top-1 or not) and the **MAPE** of the predicted
changes: each prediction applied to the as-run arm measured beside it (so the machine's drift
since the run cancels), against the arm's measurement, over every arm and figure tested;
predictions within ``MAPE_LIMIT`` pass, as the peers' contract has it.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servelab.analyze.compare import DEFAULT_ALPHA
from servelab.analyze.tuning.decision import paired_gains
from servelab.analyze.tuning.prediction import (
    CHECKED,
    HIGHER_IS_BETTER,
    Prediction,
    Spread,
    figures,
    label,
    rel_error,
)
from servelab.rundir import Run
from servelab.units import SLO
from servelab.vocab import ClientRecord

AS_RUN = "as-run"
TUNED = "tuned"  # the top-1's arm; the others are ``top-2``, ``top-3``
MIN_UPLIFT = 0.05  # the top-1's measured objective gain below which the answer is "keep"
MAPE_LIMIT = 0.20  # predicted changes within this MAPE pass
N_PERM = 200  # relabellings of the stratified test
SIGN_FLIP = "sign-flip over repeats"
STRATIFIED = "matched requests, stratified by repeat"


def arm_name(rank: int) -> str:
    """The arm of the ``rank``-th candidate (1-based): ``tuned`` for the chosen one."""
    return TUNED if rank == 1 else f"top-{rank}"


@dataclass(frozen=True)
class Arm:
    """One configuration verified: its name, what it applies, its prediction (the replay of
    the run as it ran for ``AS_RUN``) and its key figure (scope, figure)."""

    name: str
    title: str
    prediction: Prediction
    target: tuple[str, str]


@dataclass(frozen=True)
class VerifyRow:
    config: str  # the arm's name
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


@dataclass(frozen=True)
class Change:
    """One arm's change of one figure against the as-run arm (relative: -0.3 is 30% lower)."""

    scope: str
    name: str
    predicted: float | None
    measured: float | None  # mean over repeats of ``per_repeat``
    per_repeat: list[float]
    p_value: float | None
    test: str
    on_run: float | None = None  # the decision's predicted change, on the run's requests

    @property
    def gain(self) -> float | None:
        """The measured change signed so that > 0 is better."""
        if self.measured is None:
            return None
        return self.measured if self.name in HIGHER_IS_BETTER else -self.measured

    @property
    def error(self) -> float | None:
        """The absolute percentage error of the as-run measurement times the predicted change
        against the arm's measurement: |predicted - measured| / |1 + measured|."""
        if self.predicted is None or self.measured is None or self.measured == -1:
            return None
        return abs(self.predicted - self.measured) / abs(1 + self.measured)

    def to_dict(self) -> dict[str, Any]:
        return {
            "scope": self.scope,
            "figure": self.name,
            "predicted_change": self.predicted,
            "predicted_change_on_run": self.on_run,
            "measured_change": self.measured,
            "measured_per_repeat": self.per_repeat,
            "p_value": self.p_value,
            "test": self.test,
            "error": self.error,
        }


@dataclass(frozen=True)
class ArmResult:
    name: str
    title: str
    objective: Change
    key: Change  # the arm's target figure (the objective's Change where they are one)

    @property
    def changes(self) -> list[Change]:
        return [self.objective] if self.key is self.objective else [self.objective, self.key]

    def to_dict(self) -> dict[str, Any]:
        return {
            "arm": self.name,
            "title": self.title,
            "objective": self.objective.to_dict(),
            "key": self.key.to_dict(),
        }


@dataclass
class Verification:
    """``arms`` are the candidates' results, the top-1 first; ``best`` the arm measured best
    on the objective (``AS_RUN`` where none gains); ``answer`` "apply" (the top-1) or "keep"
    (module doc)."""

    repeats: int
    objective: tuple[str, str]
    arms: list[ArmResult]
    rows: list[VerifyRow]
    best: str
    mape: float | None
    answer: str
    verdict: str  # the top-1 on the objective: "better" | "worse" | "noise"
    sentence: str
    min_uplift: float = MIN_UPLIFT
    alpha: float = DEFAULT_ALPHA
    plan_seeds: list[int] = field(default_factory=list)  # the requests' seed per repeat

    @property
    def top1_best(self) -> bool:
        return bool(self.arms) and self.best == self.arms[0].name

    @property
    def mape_ok(self) -> bool | None:
        return None if self.mape is None else self.mape <= MAPE_LIMIT

    def to_dict(self) -> dict[str, Any]:
        return {
            "repeats": self.repeats,
            "plan_seeds": self.plan_seeds,
            "objective": list(self.objective),
            "arms": [a.to_dict() for a in self.arms],
            "best_measured": self.best,
            "top1_measured_best": self.top1_best,
            "mape": self.mape,
            "mape_limit": MAPE_LIMIT,
            "mape_ok": self.mape_ok,
            "min_uplift": self.min_uplift,
            "answer": self.answer,
            "verdict": self.verdict,
            "sentence": self.sentence,
            "alpha": self.alpha,
            "rows": [r.to_dict() for r in self.rows],
        }


Figure = tuple[str, str]  # (scope, figure name)


def _values(
    records: Sequence[ClientRecord], slos: dict[str, SLO], figs: Sequence[Figure]
) -> list[float | None]:
    v = figures(records, slos).values
    return [v.get(scope, {}).get(name) for scope, name in figs]


def _rel(arm: float | None, base: float | None) -> float | None:
    if arm is None or base is None or base == 0:
        return None
    return (arm - base) / abs(base)


def _mean_changes(
    pairs: Sequence[tuple[Sequence[ClientRecord], Sequence[ClientRecord]]],
    slos: dict[str, SLO],
    figs: Sequence[Figure],
) -> list[list[float]]:
    """Per figure, the relative change of each repeat where both arms gave the figure."""
    out: list[list[float]] = [[] for _ in figs]
    for base, arm in pairs:
        for i, (a, b) in enumerate(zip(_values(arm, slos, figs), _values(base, slos, figs))):
            if (c := _rel(a, b)) is not None:
                out[i].append(c)
    return out


def sign_flip_p(diffs: Sequence[float]) -> float | None:
    """Exact two-sided sign-flip permutation p-value of the mean of paired ``diffs``."""
    if len(diffs) < 2:
        return None
    d = np.asarray(diffs, float)
    obs = abs(d.mean())
    signs = np.array(list(itertools.product((1.0, -1.0), repeat=len(d))))
    return float((np.abs((signs * d).mean(axis=1)) >= obs - 1e-12).mean())


def sign_flip_resolves(repeats: int, alpha: float) -> bool:
    """Whether the sign-flip test over ``repeats`` blocks can reach ``alpha`` at all."""
    return 2.0 / 2**repeats <= alpha


def planned_id(r: ClientRecord) -> str:
    """The planned request a record is of: its id without the run's tag (a run records
    ``<tag>-<planned id>``, ``bench.plan_runner.request_id``)."""
    return r.request_id.rpartition("-")[2]


def stratified_p(
    pairs: Sequence[tuple[Sequence[ClientRecord], Sequence[ClientRecord]]],
    slos: dict[str, SLO],
    figs: Sequence[Figure],
    n_perm: int = N_PERM,
    seed: int = 0,
) -> list[float | None]:
    """Per figure, the two-sided p-value of the mean over repeats of the relative change
    (module doc): ``pairs`` holds (as-run records, arm records) per repeat; within a repeat
    the records of one ``request_id`` swap arms at random, never across repeats."""
    matched = []
    for base, arm in pairs:
        by_id = {planned_id(r): r for r in arm}
        both = [(b, by_id[planned_id(b)]) for b in base if planned_id(b) in by_id]
        ids = {planned_id(b) for b, _ in both}
        rest_b = [r for r in base if planned_id(r) not in ids]
        rest_a = [r for r in arm if planned_id(r) not in ids]
        matched.append((both, rest_b, rest_a))
    if sum(len(m[0]) for m in matched) < 2:
        return [None] * len(figs)

    def stat(swaps: list[np.ndarray]) -> list[float | None]:
        split = []
        for (both, rest_b, rest_a), s in zip(matched, swaps):
            b = [a if x else c for (c, a), x in zip(both, s)] + rest_b
            a = [c if x else a for (c, a), x in zip(both, s)] + rest_a
            split.append((b, a))
        per = _mean_changes(split, slos, figs)
        return [statistics.fmean(c) if c else None for c in per]

    observed = stat([np.zeros(len(m[0]), bool) for m in matched])
    rng = np.random.default_rng(seed)
    hits = [0] * len(figs)
    for _ in range(n_perm):
        t = stat([rng.random(len(m[0])) < 0.5 for m in matched])
        for i, (x, o) in enumerate(zip(t, observed)):
            if x is not None and o is not None and abs(x) >= abs(o) - 1e-12:
                hits[i] += 1
    return [None if o is None else (h + 1) / (n_perm + 1) for h, o in zip(hits, observed)]


def _predicted_change(base: Prediction, arm: Prediction, scope: str, name: str) -> float | None:
    gains = paired_gains(base, arm, scope, name)
    if not gains:
        return None
    med = statistics.median(gains)
    return med if name in HIGHER_IS_BETTER else -med


def _fresh_change(
    fresh: Sequence[dict[str, Prediction]], arm: str, scope: str, name: str
) -> float | None:
    """The mean over repeats of the arm's predicted change on each repeat's requests."""
    per = [c for f in fresh if (c := _predicted_change(f[AS_RUN], f[arm], scope, name)) is not None]
    return statistics.fmean(per) if per else None


def _fresh_spread(
    fresh: Sequence[dict[str, Prediction]], arm: str, scope: str, name: str
) -> Spread | None:
    """The arm's predicted figure on the repeats' requests: the mean of the repeats' medians
    (as the measured figure is the repeats' mean), the range over every repeat and seed."""
    spreads = [s for f in fresh if (s := f[arm].spread(scope, name)) is not None]
    if not spreads:
        return None
    return Spread(
        statistics.fmean(s.median for s in spreads),
        min(s.lo for s in spreads),
        max(s.hi for s in spreads),
        sum(s.n for s in spreads),
    )


def _rows(
    arms: Sequence[Arm],
    runs: dict[str, list[Run]],
    slos: dict[str, SLO],
    names: Sequence[str],
    fresh: Sequence[dict[str, Prediction]],
) -> list[VerifyRow]:
    rows = []
    for arm in arms:
        per_run = [figures(r.records, slos).values for r in runs[arm.name]]
        scopes = list(dict.fromkeys(s for f in per_run for s in f))
        for scope in scopes:
            for name in names:
                vals = [v for f in per_run if (v := f.get(scope, {}).get(name)) is not None]
                m = statistics.fmean(vals) if vals else None
                rng = (min(vals), max(vals)) if vals else None
                if fresh:
                    p = _fresh_spread(fresh, arm.name, scope, name)
                else:
                    p = arm.prediction.spread(scope, name)
                err = rel_error(p.median if p else None, m)
                rows.append(VerifyRow(arm.name, scope, name, p, m, rng, err))
    return rows


def verify(
    arms: Sequence[Arm],
    runs: dict[str, list[Run]],
    objective: Figure,
    slos: dict[str, SLO],
    alpha: float = DEFAULT_ALPHA,
    min_uplift: float = MIN_UPLIFT,
    n_perm: int = N_PERM,
    plan_seeds: Sequence[int] = (),
    names: Sequence[str] = (*CHECKED, "attainment", "goodput"),
    fresh: Sequence[dict[str, Prediction]] = (),
) -> Verification:
    """``arms[0]`` is ``AS_RUN``, the rest the candidates, top-1 first; ``runs[arm][r]`` the
    arm's run of repeat ``r`` (the same requests for every arm of a repeat); ``fresh[r][arm]``
    the arm's prediction on repeat ``r``'s requests (module doc; empty: the run's)."""
    base = arms[0]
    repeats = min(len(runs[a.name]) for a in arms)
    figs_all = (objective, *(a.target for a in arms[1:]))
    names = tuple(dict.fromkeys((*names, *(f[1] for f in figs_all))))
    test = SIGN_FLIP if sign_flip_resolves(repeats, alpha) else STRATIFIED
    results = []
    for k, arm in enumerate(arms[1:], 1):
        figs = list(dict.fromkeys((objective, arm.target)))
        pairs = [(runs[base.name][r].records, runs[arm.name][r].records) for r in range(repeats)]
        per = _mean_changes(pairs, slos, figs)
        if test == SIGN_FLIP:
            ps = [sign_flip_p(c) if len(c) == repeats else None for c in per]
        else:
            ps = stratified_p(pairs, slos, figs, n_perm, seed=k)
        changes = []
        for (scope, name), c, p in zip(figs, per, ps):
            on_run = _predicted_change(base.prediction, arm.prediction, scope, name)
            predicted = _fresh_change(fresh, arm.name, scope, name) if fresh else on_run
            mean = statistics.fmean(c) if c else None
            changes.append(Change(scope, name, predicted, mean, c, p, test, on_run))
        results.append(ArmResult(arm.name, arm.title, changes[0], changes[-1]))
    return _conclude(
        repeats,
        objective,
        results,
        _rows(arms, runs, slos, names, fresh),
        alpha,
        min_uplift,
        list(plan_seeds),
    )


def _conclude(
    repeats: int,
    objective: Figure,
    arms: list[ArmResult],
    rows: list[VerifyRow],
    alpha: float,
    min_uplift: float,
    plan_seeds: list[int],
) -> Verification:
    """The best arm, the MAPE, the answer and its sentence (module doc)."""
    gains = {a.name: g for a in arms if (g := a.objective.gain) is not None and g > 0}
    best = max(gains, key=lambda n: gains[n]) if gains else AS_RUN
    errors = [e for a in arms for c in a.changes if (e := c.error) is not None]
    mape = statistics.fmean(errors) if errors else None
    scope, name = objective
    what = label(name) + ("" if scope == "overall" else f" of {scope}")
    if not arms:
        return Verification(
            repeats, objective, arms, rows, best, mape, "keep", "noise",
            "nothing but the as-run config was measured: keep it.",
            min_uplift, alpha, plan_seeds,
        )  # fmt: skip
    top = arms[0].objective
    gain, p = top.gain, top.p_value
    verdict = "noise"
    if p is not None and p <= alpha and gain is not None and gain != 0:
        verdict = "better" if gain > 0 else "worse"
    if gain is None or p is None:
        answer, why = "keep", "its change could not be measured or tested"
    elif gain < min_uplift:
        answer, why = "keep", f"its measured gain is below the {min_uplift:.0%} uplift asked"
    elif p > alpha:
        answer, why = "keep", f"its gain is not significant (p = {p:.3g} > {alpha:g})"
    else:
        answer, why = "apply", f"it gains at least {min_uplift:.0%}, significantly"
    p_txt = "untested" if p is None else f"p = {p:.3g}"
    on_run = (
        f" on these requests, {_signed(top.on_run)} on the run's"
        if top.on_run is not None and top.on_run != top.predicted
        else ""
    )
    sentence = (
        f"{what}: {arms[0].title} measured {_signed(top.measured)} "
        f"(predicted {_signed(top.predicted)}{on_run}, {p_txt}, {top.test}); "
        f"{'apply it' if answer == 'apply' else 'keep the config as run'}: {why}. "
        + (
            "The top-1 was measured best."
            if best == arms[0].name
            else f"Measured best: {best if best == AS_RUN else _title(arms, best)}."
        )
    )
    if mape is not None:
        sentence += (
            f" MAPE of the predicted changes: {mape:.1%} "
            f"({'within' if mape <= MAPE_LIMIT else 'beyond'} {MAPE_LIMIT:.0%})."
        )
    return Verification(
        repeats, objective, arms, rows, best, mape, answer, verdict, sentence,
        min_uplift, alpha, plan_seeds,
    )  # fmt: skip


def _title(arms: Sequence[ArmResult], name: str) -> str:
    return next(f"{a.title} ({a.name})" for a in arms if a.name == name)


def _signed(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"
