"""A twin's 80% and 95% intervals from how its replays missed runs it was not fitted on.

An error in a step's price is not an error in a figure: queueing amplifies a 4% step error
into 20% in TTFT p90, and scheduling and prefix hits add their own. So the intervals are
measured on the figures themselves, leave one run out: for each training run, the twin is
fitted to the other runs alone and the run is replayed through it as ``servelab sim
--calibration FOLD --trace RUN`` would (``sim.run.build_scenario``: its sends, lengths and
shared prefixes, the settings it ran with), at simulator seed ``FOLD_SEED`` (the point fit).
Each of ``sim.intervals.FIGURES`` gives one error, ``log(predicted / measured)``, measured
from the run's ``metrics.json`` as the held-out protocol reads it.

A figure with at least ``MIN_FIGURE_ERRORS`` errors gets its own half-widths, the
``LEVELS`` quantiles of its ``|error|``; the others use the quantiles pooled over every
figure's errors, which stay the file's ``"80"`` and ``"95"`` (what older readers take).
Nothing about the cases predicted later goes in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from servelab.sim.fit.twin import TwinCalibration, calibrate_runs

if TYPE_CHECKING:
    from servelab.rundir import Run

LEVELS = (0.8, 0.95)  # the intervals a twin of several runs states
MIN_FIGURE_ERRORS = 8  # fewer, and a figure's own quantiles say little: it takes the pooled
FOLD_SEED = 0  # one seed a fold: the point fit, no bootstrap draw (keeps calibrate quick)
MIN_ERRORS = 3  # fewer in all, and no interval is stated


def calibrate_twin(
    runs: Sequence[Run],
    stated: str | None = None,
    hardware: str | None = None,
    model: str | None = None,
) -> TwinCalibration:
    """``calibrate_runs`` of ``runs`` (its arguments), its ``intervals`` from
    ``figure_intervals`` where there are two or more runs (None otherwise)."""
    cal = calibrate_runs(runs, stated, hardware, model)
    if len(runs) >= 2:
        cal.intervals = figure_intervals(
            runs, lambda others: calibrate_runs(others, stated, hardware, model)
        )
    return cal


def figure_intervals(
    runs: Sequence[Run], fit: Callable[[list[Run]], TwinCalibration]
) -> dict[str, Any] | None:
    """The half-widths (module doc) from ``fold_errors(runs, fit)``; None when fewer than
    ``MIN_ERRORS`` errors came out."""
    return half_widths(fold_errors(runs, fit), len(runs))


def fold_errors(
    runs: Sequence[Run], fit: Callable[[list[Run]], TwinCalibration]
) -> list[tuple[str, str, float]]:
    """``(run path, figure, log(predicted / measured))`` for every training run replayed on
    ``fit`` of the others. A fold whose other runs cannot be fitted, or whose run cannot
    be replayed, gives nothing; a figure missing or zero on either side gives nothing."""
    import math

    errors: list[tuple[str, str, float]] = []
    for k, held in enumerate(runs):
        try:
            fold = fit([r for j, r in enumerate(runs) if j != k])
            predicted = replayed_figures(fold, held)
        except ValueError:
            continue  # what the fold cannot fit or replay it cannot speak for
        real = measured_of(held)
        for name, p in predicted.items():
            m = real.get(name)
            if p and m:
                errors.append((str(held.path), name, math.log(p / m)))
    return errors


def replayed_figures(cal: TwinCalibration, run: Run) -> dict[str, float | None]:
    """``FIGURES`` of ``run`` replayed on ``cal`` as ``sim --calibration --trace`` does."""
    from pathlib import Path

    from servelab.bench.workloads.request_plan import LoadSpec
    from servelab.sim.intervals import figures_of
    from servelab.sim.run import build_scenario
    from servelab.sim.scenario import simulate
    from servelab.sim.spec import (
        OutputSpec,
        SearchSpec,
        SimSpec,
        TargetSpec,
        TopologySpec,
        WorkloadSpec,
    )

    load = LoadSpec(trace=str(run.path))
    spec = SimSpec(
        TargetSpec(),
        TopologySpec(),
        WorkloadSpec(load, sim_seed=FOLD_SEED),
        SearchSpec(),
        OutputSpec(Path(".")),  # nothing is written
    )
    scenario = build_scenario(spec, cal.target(FOLD_SEED))
    return figures_of(simulate(scenario, keep_steps=False).records)


def measured_of(run: Run) -> dict[str, float | None]:
    """``FIGURES`` as the run measured them: its ``metrics.json``, else from its records."""
    from servelab.sim.intervals import figures_of, measured_figures

    return measured_figures(run.metrics) if run.metrics else figures_of(run.records)


def half_widths(errors: Sequence[tuple[str, str, float]], runs: int) -> dict[str, Any] | None:
    """The twin file's ``intervals`` from ``(run, figure, log error)`` triples: the pooled
    ``LEVELS`` quantiles of ``|error|`` as ``"80"``/``"95"``, ``figures`` (name -> its own
    quantiles and ``n``, for each figure with ``MIN_FIGURE_ERRORS`` or more), every error
    and how they were derived. None with fewer than ``MIN_ERRORS`` errors."""
    import numpy as np

    if len(errors) < MIN_ERRORS:
        return None

    def quantiles(vals: Sequence[float]) -> dict[str, float]:
        sizes = np.abs(np.asarray(vals, dtype=float))
        return {f"{round(q * 100)}": float(np.quantile(sizes, q)) for q in LEVELS}

    by_figure: dict[str, list[float]] = {}
    for _, name, e in errors:
        by_figure.setdefault(name, []).append(e)
    own = {
        name: {**quantiles(v), "n": len(v)}
        for name, v in by_figure.items()
        if len(v) >= MIN_FIGURE_ERRORS
    }
    return {
        **quantiles([e for _, _, e in errors]),
        "figures": own,
        "errors": [{"run": r, "figure": n, "error": round(e, 5)} for r, n, e in errors],
        "runs": runs,
        "derived": (
            "leave-one-run-out replays: each run replayed (seed 0) on the twin fitted to the "
            "others; log(predicted/measured) per figure; quantiles of |error|, a figure's own "
            f"where it has {MIN_FIGURE_ERRORS}+, else pooled over all figures"
        ),
    }
