"""Profiled cost model: step times measured on this machine, interpolated.

A :class:`ProfileTable` is a JSON file of measured steps (each a :class:`StepWork`
and its median time), from ``servelab profile`` (a grid of batch shapes run on the
real engine) or from the steps of real runs. The model fitted to it is::

    time = g(tokens) + a * attn_pairs + b * kv_read + c * seqs + d * logits

where ``g`` is piecewise linear in the step's token count with one knot per profiled
token count (linear interpolation between knots; beyond the last one, a non-negative
slope); with ``meta["monotone"]`` it is also non-decreasing (fitted as non-negative
increments from knot to knot), for tables of one run's steps (``servelab tune``), where
decode steps carry as many tokens as sequences and a free ``g`` trades against the linear
terms in ways that price unseen shapes wrongly. ``g``
carries the weight-bound matmuls, whose cost is far from linear at small row counts
on this CPU (docs/reference-figures.md); the linear terms carry attention, per-sequence work and the
LM head. Every coefficient is non-negative (non-negative least squares, relative
error weighting), so predictions grow with work. The engine's own per-step time
(``meta["overhead"]``: ``per_step + per_seq * seqs``) is added on top. A table from real
runs also carries how far steps strayed from this fit (``meta["step_noise"]``,
:mod:`servelab.sim.costs.noise`); the executor applies it, so ``predict`` stays the typical time.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import asdict, dataclass, field
from pathlib import Path

from servelab.sim.costs.saved_doc import load_doc, save_doc
from servelab.sim.costs.work import StepWork, decode_work

FORMAT = "servelab-profile/1"

LINEAR_TERMS = ("attn_pairs", "kv_read", "seqs", "logits")


@dataclass
class ProfileSample:
    work: StepWork
    time: float  # median seconds over ``repeats``
    repeats: int = 1

    def to_dict(self) -> dict:
        return {**asdict(self.work), "time": self.time, "repeats": self.repeats}

    @classmethod
    def from_dict(cls, d: dict) -> ProfileSample:
        fields = StepWork.__dataclass_fields__
        return cls(
            work=StepWork(**{k: d[k] for k in fields if k in d}),
            time=float(d["time"]),
            repeats=int(d.get("repeats", 1)),
        )


@dataclass
class ProfileTable:
    """Measured steps plus what they were measured on."""

    model: str
    device: str
    samples: list[ProfileSample]
    meta: dict = field(default_factory=dict)

    def save(self, path: str | Path) -> Path:
        body = {
            "model": self.model,
            "device": self.device,
            "meta": self.meta,
            "samples": [s.to_dict() for s in self.samples],
        }
        return save_doc(path, FORMAT, body)

    @classmethod
    def load(cls, path: str | Path) -> ProfileTable:
        doc = load_doc(path, FORMAT, "profile table", "create one with `servelab profile`")
        return cls(
            model=doc["model"],
            device=doc["device"],
            samples=[ProfileSample.from_dict(s) for s in doc["samples"]],
            meta=doc.get("meta", {}),
        )


def _knots(token_counts: list[int], max_knots: int = 24) -> list[float]:
    """Distinct token counts, thinned geometrically when there are many (run-derived tables)."""
    values = sorted(set(token_counts))
    if len(values) <= max_knots:
        return [float(v) for v in values]
    lo, hi = values[0], values[-1]
    ratio = (hi / lo) ** (1 / (max_knots - 1))
    picks = sorted({min(values, key=lambda v: abs(v - lo * ratio**i)) for i in range(max_knots)})
    return [float(v) for v in picks]


def _hat(knots: list[float], x: float) -> list[tuple[int, float]]:
    """Weights of the piecewise-linear basis at ``knots[0] <= x <= knots[-1]``."""
    k = len(knots)
    if k == 1 or x <= knots[0]:
        return [(0, 1.0)]
    if x >= knots[-1]:
        return [(k - 1, 1.0)]
    i = bisect_right(knots, x) - 1
    x0, x1 = knots[i], knots[i + 1]
    t = (x - x0) / (x1 - x0)
    return [(i, 1.0 - t), (i + 1, t)]


def tail_slope(knots: list[float], g: list[float]) -> float:
    """The price of a token beyond the last knot: the larger of the slope over the upper half
    of the profiled range (from the last knot at or below half the last token count) and
    the average slope over all knots. Past the profiled range steps are compute-bound and
    cost more per token, not less; and the slope of the last segment alone is noise over a
    few tokens where the knots are a run's own steps (knots 811 and 814 of one run's RAG
    prefills, 118 ms apart, priced a 1,559-token step at 31 s instead of about 3)."""
    k = len(knots)
    if k == 1:
        return max(g[0] / max(knots[0], 1.0), 0.0)
    j = max(bisect_right(knots, knots[-1] / 2) - 1, 0)
    if j == k - 1:
        j = k - 2
    upper = (g[-1] - g[j]) / (knots[-1] - knots[j])
    overall = (g[-1] - g[0]) / (knots[-1] - knots[0])
    return max(upper, overall, 0.0)


class ProfiledCostModel:
    """Interpolates a :class:`ProfileTable` (see the module docstring for the form).

    ``fit_error`` is the median absolute relative error on the table's own samples.
    """

    def __init__(self, table: ProfileTable) -> None:
        import numpy as np
        from scipy.optimize import nnls

        if len(table.samples) < 3:
            raise ValueError(
                f"the profile table has {len(table.samples)} samples; at least 3 are needed "
                "(re-run `servelab profile`)"
            )
        self.table = table
        self.knots = _knots([s.work.tokens for s in table.samples])
        k = len(self.knots)
        monotone = bool(table.meta.get("monotone"))
        rows = []
        for s in table.samples:
            row = [0.0] * (k + len(LINEAR_TERMS))
            for i, wt in _hat(self.knots, s.work.tokens):
                # monotone: g at knot i is the sum of the increments of knots 0..i
                for j in range(i + 1) if monotone else (i,):
                    row[j] += wt
            for j, term in enumerate(LINEAR_TERMS):
                row[k + j] = float(getattr(s.work, term))
            rows.append(row)
        a = np.asarray(rows)
        y = np.asarray([s.time for s in table.samples])
        # Column scaling keeps NNLS well conditioned (attn_pairs reach 1e6, seqs 1e1).
        col = np.maximum(np.abs(a).max(axis=0), 1e-12)
        # Relative error, so that a 1 ms step matters as much as a 1 s one. Weighting by each
        # noisy measurement biases the fit low (small outliers weigh most), so after a first
        # pass the weights come from the fitted values instead.
        weight = 1.0 / np.maximum(y, 1e-6)
        for _ in range(3):
            coef, _ = nnls(a / col * weight[:, None], y * weight, maxiter=50 * a.shape[1])
            coef = coef / col
            weight = 1.0 / np.maximum(a @ coef, 1e-6)
        self.g = [float(c) for c in (np.cumsum(coef[:k]) if monotone else coef[:k])]
        self.coef = {t: float(c) for t, c in zip(LINEAR_TERMS, coef[k:])}
        self._tail_slope = tail_slope(self.knots, self.g)
        errs = [
            abs(self.interpolate(s.work) - s.time) / s.time for s in table.samples if s.time > 0
        ]
        self.fit_error = float(np.median(errs)) if errs else math.nan
        # The engine's own time around each step (``workflows/profile.py``, ``sim/fit/run_profile.py``).
        overhead = table.meta.get("overhead", {})
        self._overhead_step = float(overhead.get("per_step", 0.0))
        self._overhead_seq = float(overhead.get("per_seq", 0.0))
        self.name = f"profile:{table.device}:{table.model}"

    def predict(self, w: StepWork) -> float:
        """The step's time: the engine's overhead around it plus :meth:`interpolate`."""
        return self._overhead_step + self._overhead_seq * w.seqs + self.interpolate(w)

    def decode_time(self, num_seqs: int, context_tokens: int) -> float:
        """``predict`` of a step of ``num_seqs`` one-token decodes after ``context_tokens``."""
        return self.predict(decode_work(num_seqs, context_tokens))

    def interpolate(self, w: StepWork) -> float:
        """The fitted executor time alone (what the table's samples measured)."""
        if w.tokens > self.knots[-1]:
            t = self.g[-1] + self._tail_slope * (w.tokens - self.knots[-1])
        else:
            t = 0.0
            for i, wt in _hat(self.knots, w.tokens):
                t += wt * self.g[i]
        c = self.coef
        t += (
            c["attn_pairs"] * w.attn_pairs
            + c["kv_read"] * w.kv_read
            + c["seqs"] * w.seqs
            + c["logits"] * w.logits
        )
        return t

    def describe(self) -> dict:
        return {
            "kind": "profile",
            "model": self.table.model,
            "device": self.table.device,
            "samples": len(self.table.samples),
            "knots": self.knots,
            "g": self.g,
            "coef": self.coef,
            "fit_error_median": self.fit_error,
            "meta": self.table.meta,
        }
