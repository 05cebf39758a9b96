"""`servelab calibrate` and `servelab profile`: the simulator's measured inputs (a fitted
calibration, a profile table). Parse -> spec -> call; no heavy imports at module level."""

from __future__ import annotations

from dataclasses import dataclass

import typer

from servelab.cli.errors import fail, note_old_spelling
from servelab.cli.extras import require_engine
from servelab.cli.field_options import command_from_fields, flag, spec_from_flags
from servelab.vocab import DEFAULT_MODEL


@dataclass(frozen=True)
class CalibrateFlags:
    run_dirs: list[str] | None = flag(
        None,
        "A run directory: of a servelab server on the target hardware, or of another "
        "server (vLLM, SGLang, llama.cpp), whose twin is fitted from its client timestamps; "
        "several runs of that server in one configuration (e.g. before and after a restart) "
        "make the twin's ranges carry how far its speed moves between runs. A `calibrate "
        "--plan` directory counts as its rungs: give it beside a run from another launch.",
        argument=True,
        show_default=False,
    )
    plan: bool = flag(
        False,
        "Measure the server at --url with a ladder of short runs (prompt lengths up to "
        "--max-prompt, a concurrency ladder, a shared prefix), a few minutes, and fit its "
        "twin to them: the twin's domain then spans what you will predict.",
    )
    url: str | None = flag(None, "With --plan: the base URL of the server to measure.")
    max_prompt: int | None = flag(
        None,
        "With --plan: the longest prompt the ladder sends, in tokens: the longest you will "
        "predict (default 2048, capped by the server's context).",
        show_default=False,
    )
    concurrency: str = flag("1,2,4,8", "With --plan: the stream counts of the decode ladder.")
    api_key: str | None = flag(
        None,
        "With --plan: bearer token; never written to the run directories.",
        envvar=["OPENAI_API_KEY", "SERVELAB_API_KEY"],
        show_default=False,
        show_envvar=True,
    )
    hardware: str | None = flag(
        None,
        "The catalogue entry the run's hardware is (e.g. cpu, h100); required for a "
        "servelab run, the engine's hardware defaults for another server's.",
    )
    model: str | None = flag(
        None,
        f"The model that served the run (default {DEFAULT_MODEL}; another server's: its own).",
    )
    tp: int = flag(1, "Tensor parallel degree of the run.")
    server_config: str | None = flag(
        None,
        "Another server's launch command or flags, e.g. 'vllm serve M "
        "--no-enable-chunked-prefill', where the run did not record them.",
    )
    out: str | None = flag(
        None,
        "Where to write the fit (default calibration.json); with --plan, the directory of "
        "the ladder's runs and its twin.json (default runs/calibrate-STAMP).",
        show_default=False,
    )


_PLAN_ONLY = ("url", "max_prompt")


def calibrate(flags: CalibrateFlags) -> None:
    """Fit the roofline's efficiencies and fixed costs to a measured run, or a twin of another
    server to its runs' client timestamps, or (--plan) measure a live server with a ladder of
    short runs and fit its twin to them; report the fit error."""
    from rich.console import Console

    from servelab.rundir import RunDirError

    if flags.plan:
        _calibrate_plan(flags)
        return
    given = [f"--{k.replace('_', '-')}" for k in _PLAN_ONLY if getattr(flags, k) is not None]
    if given:
        raise fail(f"{given[0]} measures a live server: add --plan", "calibrate")
    if not flags.run_dirs:
        raise fail("give a run directory, or --plan --url URL to measure a server", "calibrate")
    from servelab.sim.calibration_run import CalibrateSpec, run_calibrate

    spec = spec_from_flags(
        CalibrateSpec,
        flags,
        run_dirs=tuple(flags.run_dirs),
        out=flags.out or "calibration.json",
    )
    try:
        run_calibrate(spec, Console())
    except (RunDirError, ValueError) as e:
        raise fail(str(e)) from None


def _calibrate_plan(flags: CalibrateFlags) -> None:
    from rich.console import Console

    from servelab.rundir import RunDirError
    from servelab.workflows.calibration_plan import CalibrationPlanSpec, run_calibration_plan

    if flags.run_dirs:
        raise fail("--plan makes its own runs: drop the run directories", "calibrate")
    try:
        streams = tuple(int(c) for c in flags.concurrency.split(","))
    except ValueError:
        raise fail(
            f"--concurrency {flags.concurrency!r}: give stream counts such as 1,2,4,8",
            "calibrate",
        ) from None
    spec = spec_from_flags(CalibrationPlanSpec, flags, concurrency=streams)
    try:
        run_calibration_plan(spec, Console())
    except (RunDirError, ValueError) as e:
        raise fail(str(e), "calibrate") from None


@dataclass(frozen=True)
class ProfileFlags:
    model: str = flag(DEFAULT_MODEL, "Model to profile (short name, .gguf or HF dir).")
    out: str = flag("profile.json", "Where to write the profile table.")
    grid: str = flag("default", "default (about 70 shapes, minutes) or quick.")
    repeats: int = flag(2, "Timed runs per shape (after one warm-up); the median is kept.")
    threads: int | None = flag(
        None, "Torch/BLAS threads (default: what `servelab serve` uses, all cores but one)."
    )
    device: str | None = flag(None, "cpu or cuda (default: the loader's choice).")
    engine_args: str | None = flag(
        None, "Engine settings recorded with the table (e.g. '--kv-cache-memory 2G')."
    )
    from_run: list[str] | None = flag(
        None, "Build the table from these real runs' steps instead of a grid (repeatable)."
    )
    quantization: str = flag(
        "none",
        "Weights as `servelab serve --quantization` runs them: none (fp32), bf16 or q4_1.",
        decls=("--quantization",),
    )


def profile(flags: ProfileFlags) -> None:
    """Measure the real engine's step times on this machine; `servelab sim --profile` replays them."""
    require_engine("profile")
    from servelab.workflows.profile import ProfileSpec, run_profile

    note_old_spelling(flags.engine_args)
    spec = spec_from_flags(ProfileSpec, flags, from_runs=tuple(flags.from_run or ()))
    try:
        run_profile(spec, typer.echo)
    except ValueError as e:
        raise fail(str(e)) from None


COMMANDS = {
    "calibrate": command_from_fields(CalibrateFlags, calibrate),
    "profile": command_from_fields(ProfileFlags, profile),
}
