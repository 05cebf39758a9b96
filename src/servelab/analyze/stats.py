"""The statistics behind every reported figure. Pure numpy.

- ``describe(values, groups=None) -> Stat``: p50/p90/p95/p99/mean/max with confidence
  intervals. The interval is a percentile bootstrap; grouped values (pooled ITL, grouped by
  request) are resampled by group (a cluster bootstrap), because the gaps of one request are
  correlated. Above ``BOOTSTRAP_MAX_N`` values the cluster-robust Woodruff interval replaces
  the bootstrap (same limit, seconds instead of minutes).
- Rank correlation and a least-squares step cost model for the diagnosis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np

from servelab.vocab import PERCENTILES, StepRecord

DEFAULT_N_BOOT = 1000
BOOTSTRAP_MAX_N = 2_000  # beyond this many values, Woodruff intervals instead of a bootstrap
DEFAULT_CONFIDENCE = 0.95


def ranks(x: Sequence[float]) -> np.ndarray:
    """Ranks 1..n with ties given their average rank."""
    a = np.asarray(x, dtype=float)
    order = np.argsort(a, kind="mergesort")
    r = np.empty(len(a), dtype=float)
    r[order] = np.arange(1, len(a) + 1)
    uniq, inv = np.unique(a, return_inverse=True)
    if len(uniq) < len(a):
        sums = np.bincount(inv, weights=r)
        counts = np.bincount(inv)
        r = (sums / counts)[inv]
    return r


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation; 0.0 when either side is constant or n < 3."""
    if len(x) < 3 or len(x) != len(y):
        return 0.0
    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return 0.0
    return float(np.corrcoef(rx, ry)[0, 1])


def confidence_label(score: float) -> str:
    """Map a 0..1 confidence score to the word shown to users."""
    return "high" if score >= 0.75 else "medium" if score >= 0.45 else "low"


@dataclass(kw_only=True)
class FittedStepCost:
    """step duration ~ overhead + prefill_per_token * prefill tokens + decode_per_seq * decodes.

    Fitted by least squares over the run's own steps, so it reflects this machine
    under this run's load. ``r2`` says how well the linear model fits.
    """

    overhead: float
    prefill_per_token: float
    decode_per_seq: float
    r2: float
    n_steps: int

    def predict(self, prefill_tokens: float, decode_seqs: float) -> float:
        return (
            self.overhead
            + self.prefill_per_token * prefill_tokens
            + self.decode_per_seq * decode_seqs
        )


def fit_step_cost(steps: Sequence[StepRecord]) -> FittedStepCost | None:
    """Fit the step cost model; None with fewer than 8 steps or no prefill at all."""
    if len(steps) < 8:
        return None
    x = np.array([[1.0, s.prefill_tokens, s.decode_seqs] for s in steps])
    y = np.array([s.duration for s in steps])
    if not x[:, 1].any():
        return None
    cols = [0, 1] + ([2] if x[:, 2].any() else [])
    coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
    full = np.zeros(3)
    full[cols] = coef
    # A negative cost is fitting noise; clamp and refit the rest so the parts stay additive.
    if (full[1:] < 0).any():
        keep = [c for c in cols if c == 0 or full[c] > 0]
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        full = np.zeros(3)
        full[keep] = coef
    pred = x @ full
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return FittedStepCost(
        overhead=float(max(full[0], 0.0)),
        prefill_per_token=float(full[1]),
        decode_per_seq=float(full[2]),
        r2=r2,
        n_steps=len(steps),
    )


@dataclass
class Stat:
    """Distribution summary of one metric: ``n``, mean, max, p50/p90/p95/p99 and their CIs.

    ``ci[name] = (low, high)`` for name in ``p50, p90, p95, p99, mean``; all values None
    when ``n == 0``.
    """

    n: int = 0
    mean: float | None = None
    max: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    ci: dict[str, tuple[float, float]] = field(default_factory=dict)
    confidence: float = DEFAULT_CONFIDENCE

    def to_dict(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "mean": self.mean,
            "max": self.max,
            **{f"p{p}": getattr(self, f"p{p}") for p in PERCENTILES},
            "ci": {k: list(v) for k, v in self.ci.items()},
            "confidence": self.confidence,
        }


def describe(
    values: Sequence[float] | np.ndarray,
    groups: Sequence[int] | np.ndarray | None = None,
    *,
    confidence: float = DEFAULT_CONFIDENCE,
    n_boot: int = DEFAULT_N_BOOT,
    seed: int = 0,
) -> Stat:
    """Percentiles, mean and max of ``values`` with confidence intervals.

    ``groups[i]`` names the cluster (request) of ``values[i]``; with groups, intervals
    account for values of one cluster being correlated. Up to ``BOOTSTRAP_MAX_N`` values
    the interval is a percentile bootstrap (``n_boot`` resamples, whole clusters with
    groups; deterministic for a ``seed``); beyond, where a bootstrap would take minutes and
    the normal approximation it converges to is accurate, it is the Woodruff interval
    (see ``_woodruff``). ``n_boot=0`` skips CIs.
    """
    v = np.asarray(values, dtype=np.float64)
    keep = np.isfinite(v)
    if not keep.all():  # else no copies: a pooled ITL runs to millions of values
        v = v[keep]
        if groups is not None:
            groups = np.asarray(groups)[keep]
    if v.size == 0:
        return Stat(confidence=confidence)
    # one selection for all four (the same order statistics as four separate calls)
    pcts = np.percentile(v, PERCENTILES)
    p50, p90, p95, p99 = (float(x) for x in pcts)
    stat = Stat(
        n=int(v.size),
        p50=p50,
        p90=p90,
        p95=p95,
        p99=p99,
        mean=float(v.mean()),
        max=float(v.max()),
        confidence=confidence,
    )
    if n_boot > 0 and v.size > 1:
        if v.size <= BOOTSTRAP_MAX_N:
            stat.ci = _bootstrap(v, groups, confidence, n_boot, seed)
        else:
            stat.ci = _woodruff(v, groups, confidence, pcts)
    return stat


def _labels(groups: Sequence[int] | np.ndarray) -> np.ndarray:
    """``np.unique(groups, return_inverse=True)[1]``: each value's rank among the distinct
    values; read off in one pass when the groups come sorted (pooled gaps do)."""
    g = np.asarray(groups)
    if g.size and g.dtype.kind in "iu" and bool((g[1:] >= g[:-1]).all()):
        inv = np.zeros(g.size, np.intp)
        np.cumsum(g[1:] != g[:-1], out=inv[1:])
        return inv
    return np.unique(g, return_inverse=True)[1]


def _woodruff(
    v: np.ndarray,
    groups: Sequence[int] | np.ndarray | None,
    confidence: float,
    pcts: np.ndarray,
) -> dict[str, tuple[float, float]]:
    """Large-sample intervals: for a quantile q, the standard error ``se`` of the empirical
    CDF at the q-quantile gives ``[quantile(q - z se), quantile(q + z se)]`` (Woodruff, 1952);
    for the mean, its standard error. With groups both are cluster-robust (ratio-estimator
    linearisation over clusters), as the cluster bootstrap would be. ``pcts`` are ``v``'s
    ``PERCENTILES``."""
    z = NormalDist().inv_cdf(0.5 + confidence / 2.0)
    n = v.size
    g = None if groups is None else _labels(groups)

    def se_of(resid: np.ndarray) -> float:
        if g is None:
            return float(np.sqrt((resid**2).sum() * n / max(n - 1, 1))) / n
        per = np.bincount(g, weights=resid)
        k = per.size
        return float(np.sqrt((per**2).sum() * k / max(k - 1, 1))) / n

    levels: list[float] = []
    for p, xq in zip(PERCENTILES, pcts):
        q = p / 100.0
        # (v <= xq) - q in one pass: 1.0 - q where at or below, -q (0.0 - q) elsewhere
        se = se_of(np.where(v <= xq, 1.0 - q, -q))
        levels += [max(0.0, q - z * se), min(1.0, q + z * se)]
    ends = np.quantile(v, levels).tolist()  # one selection for all eight
    out: dict[str, tuple[float, float]] = {
        f"p{p}": (ends[2 * k], ends[2 * k + 1]) for k, p in enumerate(PERCENTILES)
    }
    m = float(v.mean())
    se = se_of(v - m)
    out["mean"] = (m - z * se, m + z * se)
    return out


def _bootstrap(
    v: np.ndarray,
    groups: Sequence[int] | np.ndarray | None,
    confidence: float,
    n_boot: int,
    seed: int,
) -> dict[str, tuple[float, float]]:
    # Resampling with replacement == giving each cluster a multinomial count; a weighted
    # quantile over the values sorted once then needs no copying of resampled arrays.
    order = np.argsort(v, kind="stable")
    vs = v[order]
    if groups is None:
        g = np.arange(v.size)
    else:
        _, g = np.unique(np.asarray(groups)[order], return_inverse=True)
    n_groups = int(g.max()) + 1
    rng = np.random.default_rng(seed)
    qs = [p / 100.0 for p in PERCENTILES]
    out: dict[str, list[float]] = {f"p{p}": [] for p in PERCENTILES}
    out["mean"] = []
    batch = max(1, int(4_000_000 // vs.size))
    done = 0
    while done < n_boot:
        b = min(batch, n_boot - done)
        counts = rng.multinomial(n_groups, np.full(n_groups, 1.0 / n_groups), size=b)
        w = counts[:, g]
        cw = np.cumsum(w, axis=1)
        total = cw[:, -1:]
        for p, q in zip(PERCENTILES, qs):
            idx = np.argmax(cw >= q * total, axis=1)
            out[f"p{p}"].extend(vs[idx].tolist())
        out["mean"].extend(((w * vs).sum(axis=1) / total[:, 0]).tolist())
        done += b
    alpha = (1.0 - confidence) / 2.0
    return {
        k: (float(np.quantile(s, alpha)), float(np.quantile(s, 1.0 - alpha)))
        for k, s in out.items()
    }


# --------------------------------------------------------------------------- grouping
