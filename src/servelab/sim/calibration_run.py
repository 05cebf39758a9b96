"""`servelab calibrate` below the CLI: ``run_calibrate(spec, console)`` fits the roofline's
efficiencies to a servelab run's steps (``sim.fit.calibrate``), or another server's twin to
its runs' client timestamps (``sim.fit.twin``), writes the fit and prints what the command
prints.

Raises ValueError (or ``RunDirError`` for a run it cannot read) naming the flag to fix.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from servelab.sim.run import say
from servelab.vocab import DEFAULT_MODEL

if TYPE_CHECKING:
    from rich.console import Console

    from servelab.rundir import Run


@dataclass(frozen=True)
class CalibrateSpec:
    """The ``run_dirs`` to fit (one servelab run, or one or more runs of another server, a
    ``calibrate --plan`` directory counting as its rungs),
    the ``hardware`` and ``model`` they ran (another server's: its own model by default),
    its ``tp`` degree, another server's stated ``server_config``, and the file to write."""

    run_dirs: tuple[str, ...]
    hardware: str | None = None
    model: str | None = None
    tp: int = 1
    server_config: str | None = None
    out: str = "calibration.json"


def plan_rungs(plan_dir: Path) -> list[Path]:
    """The run directories of a ``calibrate --plan`` ladder's fitted rungs (its warm-up left
    out, as the plan's own twin leaves it), in the ladder's order."""
    rungs = json.loads((plan_dir / "plan.json").read_text())["rungs"]
    return [plan_dir / r["name"] for r in rungs if r["kind"] != "warmup"]


def expand_plans(run_dirs: Sequence[str]) -> list[str]:
    """``run_dirs`` with each ``calibrate --plan`` directory (it holds ``plan.json``) given as
    its rungs: a ladder and runs from other launches fit one twin, whose level then sits
    between the launches' speeds (docs/design/twin.md)."""
    out: list[str] = []
    for d in run_dirs:
        is_plan = (Path(d) / "plan.json").is_file()
        out += [str(p) for p in plan_rungs(Path(d))] if is_plan else [d]
    return out


def run_calibrate(spec: CalibrateSpec, console: Console) -> None:
    """Fit what ``spec`` asks for, write it to ``spec.out`` and say how to use it."""
    from servelab.rundir import load_run
    from servelab.sim.costs.hardware import get_hardware
    from servelab.sim.costs.model_shapes import load_model_spec
    from servelab.sim.fit.calibrate import fit_efficiency
    from servelab.sim.fit.recorded_steps import measured_steps

    runs = [load_run(d) for d in expand_plans(spec.run_dirs)]
    run = runs[0]
    if not run.steps and not run.simulated:
        _calibrate_twin(runs, spec, console)
        return
    if len(runs) > 1:
        raise ValueError("give one servelab run: several runs calibrate another server's twin")
    if spec.hardware is None:
        raise ValueError("--hardware: say which catalogue entry the run's hardware is")
    cal = fit_efficiency(
        load_model_spec(spec.model or DEFAULT_MODEL),
        get_hardware(spec.hardware),
        measured_steps(run),
        tp=spec.tp,
    )
    cal.save(spec.out)
    say(console, json.dumps({"efficiency": cal.efficiency.to_dict(), "fit": cal.fit}, indent=1))
    say(
        console,
        f"wrote {spec.out}; use it with "
        f"`servelab sim --hardware {spec.hardware} --calibration {spec.out}`",
    )


def _calibrate_twin(runs: list[Run], spec: CalibrateSpec, console: Console) -> None:
    from servelab.bench.manifest import redact
    from servelab.report.twin_tables import calibration_table
    from servelab.sim.fit.held_out import calibrate_twin

    stated = spec.server_config
    stated = shlex.join(redact(shlex.split(stated))) if stated else None
    cal = calibrate_twin(runs, stated, spec.hardware, spec.model)
    cal.save(spec.out)
    console.print(calibration_table(dataclasses.asdict(cal)))
    say(
        console,
        f"wrote {spec.out}; predict with `servelab sim --calibration {spec.out} --workload W "
        "--rate R --seeds 8` (--engine-args for other settings)",
    )
