"""A profile made of the steps of real runs, and the engine's per-step overhead fitted to them.

The real engine's grid profile (``servelab profile``) is a workflow (``workflows/profile.py``):
it loads the torch runtime. This module reads run directories only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from servelab.engine.engine_config import EngineConfig
from servelab.sim.costs.profiled import ProfileSample, ProfileTable


def fit_overhead(rows: list[tuple[int, float]]) -> dict[str, float]:
    """``per_step + per_seq * seqs`` fitted to ``(seqs, seconds)`` rows by least squares
    (the mean, which is what every step pays on average); the median with no per-sequence
    term when the slope comes out negative or there are too few rows to fit one."""
    import numpy as np

    if not rows:
        return {"per_step": 0.0, "per_seq": 0.0, "steps": 0}
    x = np.array([[1.0, s] for s, _ in rows])
    y = np.array([o for _, o in rows])
    (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
    if b < 0 or len(rows) < 3:
        a, b = float(np.median(y)), 0.0
    return {"per_step": max(float(a), 0.0), "per_seq": float(b), "steps": len(rows)}


def table_from_runs(
    run_dirs: list[str],
    model: str,
    device: str = "cpu",
    monotone: bool = False,
    keep: Callable[[float], bool] | None = None,
) -> ProfileTable:
    """A profile made of the steps of real runs ("profile on one set of workloads").
    ``monotone`` fits a non-decreasing token term (``sim.costs.profiled``); ``keep`` (a
    step's start -> whether to fit it) fits the steps it keeps only, every other step
    still giving the context of the ones after it (an out-of-sample fit).

    Each recorded step becomes a sample (its rebuilt work and its duration). The overhead
    is fitted to the busy gaps between steps (``replay.busy_gaps``) against the sequences
    of the step before; the step noise (``sim.costs.noise``) is measured from each step's duration
    over the fitted model's, in step order, and the resent-history divergence
    (``sim.loop.history``) from the sessions' prefix hits, and how the runs' speeds differed
    (``sim.costs.drift``). The KV layout, context and engine config come from the first run's
    manifest when it recorded them, and the weights' mode from the servers' ``/version``
    (runs of different modes are refused: their steps price different kernels).
    """
    from servelab.rundir import load_run
    from servelab.sim.costs.drift import run_speeds
    from servelab.sim.costs.noise import StepNoise
    from servelab.sim.costs.profiled import ProfiledCostModel
    from servelab.sim.fit.recorded_steps import busy_gaps, measured_steps
    from servelab.sim.loop import history

    per_run: list[list[ProfileSample]] = []
    gaps: list[tuple[int, float]] = []
    meta: dict[str, Any] = {"from_runs": list(run_dirs)}
    if monotone:
        meta["monotone"] = True
    runs = [load_run(d) for d in run_dirs]
    for run in runs:
        steps = measured_steps(run)
        fitted_steps = steps
        if keep is not None:
            starts = [s.start for s in sorted(run.steps, key=lambda s: s.step_id)]
            kept = [keep(t) for t in starts]
            fitted_steps = [m for m, k in zip(steps, kept, strict=True) if k]
            # the gap before a held-out step is held out too (it is that step's overhead)
            steps = [m if k else replace(m, gap=None) for m, k in zip(steps, kept, strict=True)]
        per_run.append([ProfileSample(m.work, m.duration) for m in fitted_steps if m.duration > 0])
        gaps += busy_gaps(steps)
        mode = run.server.get("quantization")
        if mode is not None and meta.setdefault("quantization", mode) != mode:
            raise ValueError(
                f"{run.name} ran {mode} weights and an earlier run "
                f"{meta['quantization']}: profile one weight mode at a time"
            )
        if "engine_config" not in meta and run.engine_config:
            meta["engine_config"] = {
                k: v for k, v in run.engine_config.items() if k in EngineConfig.__dataclass_fields__
            }
    table = ProfileTable(model, device, [s for run in per_run for s in run], meta)
    fitted = ProfiledCostModel(table)
    speeds = run_speeds(per_run, fitted.interpolate)
    if speeds is not None:
        meta["run_speeds"] = speeds
    noise = StepNoise.measure(
        [[s.time / fitted.interpolate(s.work) for s in run] for run in per_run]
    )
    if noise is not None:
        meta["step_noise"] = noise.to_dict()
    resend = history.measure(runs)
    if resend is not None:
        meta["resend_divergence"] = resend
    meta["overhead"] = fit_overhead(gaps)
    return table
