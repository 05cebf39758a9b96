"""Calibration: fit the roofline's efficiencies and fixed costs to one measured run.

Given a run directory of a servelab server on the target hardware, every step's work
is rebuilt (:mod:`servelab.sim.fit.recorded_steps`) and the roofline is fitted to the recorded
step durations, minimising squared *relative* error:

- ``mfu`` and ``mbu`` by a log-spaced grid search (each in [0.01, 1]);
- for each grid point, ``step_overhead`` and ``seq_overhead`` (non-negative) by least
  squares; ``layer_overhead`` is folded into ``step_overhead`` (one run cannot tell
  them apart).

The engine's busy gap between steps (the median, :func:`replay.busy_gap`) is then added
to ``step_overhead``, so that simulated steps keep the measured cadence. The fit error
(median and p90 of |predicted - measured| / measured over the steps) is reported for the
default efficiencies and for the fitted ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servelab.sim.costs.dtypes import Precision
from servelab.sim.costs.hardware import Hardware
from servelab.sim.costs.model_shapes import ModelSpec
from servelab.sim.costs.roofline import Efficiency, RooflineCostModel
from servelab.sim.costs.saved_doc import load_doc, save_doc
from servelab.sim.fit.recorded_steps import MeasuredStep, busy_gap

FORMAT = "servelab-calibration/1"


@dataclass
class Calibration:
    hardware: str
    model: str
    tp: int
    efficiency: Efficiency
    fit: dict[str, Any]

    def save(self, path: str | Path) -> Path:
        body = {
            "hardware": self.hardware,
            "model": self.model,
            "tp": self.tp,
            "efficiency": self.efficiency.to_dict(),
            "fit": self.fit,
        }
        return save_doc(path, FORMAT, body)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        make = "make one with `servelab calibrate RUN_DIR`"
        doc = load_doc(path, FORMAT, "calibration file", make)
        return cls(
            doc["hardware"], doc["model"], doc["tp"], Efficiency(**doc["efficiency"]), doc["fit"]
        )


def _errors(model: RooflineCostModel, steps: list[MeasuredStep]) -> dict[str, float]:
    import numpy as np

    err = np.array([abs(model.predict(m.work) - m.duration) / m.duration for m in steps])
    return {
        "median": float(np.median(err)),
        "p90": float(np.percentile(err, 90)),
        "steps": len(steps),
    }


def fit_efficiency(
    spec: ModelSpec,
    hardware: Hardware,
    steps: list[MeasuredStep],
    tp: int = 1,
    precision: Precision | None = None,
    grid: int = 48,
) -> Calibration:
    """Fit :class:`Efficiency` to ``steps`` (see the module docstring)."""
    import numpy as np

    steps = [m for m in steps if m.duration > 0 and m.work.tokens > 0]
    if len(steps) < 4:
        raise ValueError(
            f"only {len(steps)} usable steps; calibrate on a run with at least a few dozen steps"
        )
    probe = RooflineCostModel(
        spec,
        hardware,
        tp=tp,
        efficiency=Efficiency(1.0, 1.0, 0.0, 0.0),
        precision=precision,
    )
    costs = [probe.cost(m.work) for m in steps]
    # Each kernel class's compute (at mfu = 1) and memory (at mbu = 1) time.
    gemm_c = np.array([c.gemm_compute for c in costs])
    gemm_m = np.array([c.gemm_memory for c in costs])
    attn_c = np.array([c.attn_compute for c in costs])
    attn_m = np.array([c.attn_memory for c in costs])
    comm = np.array([c.comm_time for c in costs])
    meas = np.array([m.duration for m in steps])
    seqs = np.array([m.work.seqs for m in steps], dtype=float)
    inv = 1.0 / meas
    a = np.stack([inv, seqs * inv], axis=1)

    def solve(mfu: float, mbu: float) -> tuple[float, float, float]:
        """Loss and the non-negative fixed costs that minimise it at (mfu, mbu)."""
        base = np.maximum(gemm_c / mfu, gemm_m / mbu) + np.maximum(attn_c / mfu, attn_m / mbu)
        base = base + comm
        b = (meas - base) * inv
        (c0, c1), *_ = np.linalg.lstsq(a, b, rcond=None)
        if c1 < 0:
            c1 = 0.0
            c0 = float(np.dot(a[:, 0], b) / np.dot(a[:, 0], a[:, 0]))
        if c0 < 0:
            c0 = 0.0
            c1 = max(float(np.dot(a[:, 1], b) / max(np.dot(a[:, 1], a[:, 1]), 1e-30)), 0.0)
        resid = (base + c0 + c1 * seqs - meas) * inv
        return float(np.dot(resid, resid)), float(c0), float(c1)

    levels = np.geomspace(0.01, 1.0, grid)
    _, mfu, mbu = min((solve(f, b)[0], f, b) for f in levels for b in levels)

    # Refine around the best grid point (log space keeps both inside (0, 1]).
    from scipy.optimize import minimize

    def loss(x: np.ndarray) -> float:
        f, b = np.exp(np.minimum(x, 0.0))
        return solve(f, b)[0]

    res = minimize(
        loss,
        np.log([mfu, mbu]),
        method="Nelder-Mead",
        options={"xatol": 1e-4, "fatol": 1e-12, "maxiter": 400},
    )
    mfu, mbu = (float(v) for v in np.exp(np.minimum(res.x, 0.0)))
    _, c0, c1 = solve(mfu, mbu)
    fitted = Efficiency(mfu=mfu, mbu=mbu, step_overhead=c0, layer_overhead=0.0, seq_overhead=c1)
    default = RooflineCostModel(spec, hardware, tp=tp, precision=precision)
    after = RooflineCostModel(spec, hardware, tp=tp, efficiency=fitted, precision=precision)
    gap = busy_gap(steps)
    fit = {
        "error_default": _errors(default, steps),
        "error_fitted": _errors(after, steps),
        "step_overhead_in_step": c0,
        "busy_gap_between_steps": gap,
        "compute_bound_steps": sum(after.cost(m.work).bound == "compute" for m in steps),
    }
    fitted.step_overhead = c0 + gap
    return Calibration(hardware.name, spec.name, tp, fitted, fit)
