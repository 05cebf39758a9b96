"""Small statistics the diagnosis needs beyond summary.py's percentiles: rank
correlation and a least-squares step cost model. Pure numpy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from servelab.vocab import StepRecord


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


@dataclass
class StepCost:
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


def fit_step_cost(steps: Sequence[StepRecord]) -> StepCost | None:
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
    return StepCost(float(max(full[0], 0.0)), float(full[1]), float(full[2]), r2, len(steps))
