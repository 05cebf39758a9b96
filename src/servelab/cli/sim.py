"""`servelab sim`: parse -> spec -> call. No heavy imports at module level.

Its options are ``SimFlags``' fields (the workload and load ones, ``LoadFlags``, shared with
`servelab bench`); ``sim_spec`` turns them into a ``SimSpec`` and ``sim.run.run_sim`` runs it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from servelab.cli.errors import fail, note_old_spelling, seconds
from servelab.cli.field_options import command_from_fields, flag, spec_from_flags
from servelab.cli.load_options import (
    LENGTH,
    LOAD,
    OUTPUT,
    SLO_SEARCH,
    TARGET,
    WORKLOAD,
    LoadFlags,
)
from servelab.vocab import DEFAULT_MODEL

if TYPE_CHECKING:
    from servelab.sim.spec import SimSpec

DEPLOYMENT = "Deployment"


@dataclass(frozen=True)
class SimFlags:
    """`servelab sim`'s flags, in the order its help lists them within each panel."""

    hardware: str | None = flag(
        None,
        "Hardware to simulate: h100, h200, b200, a100, a100-40gb, l4, mi300x, cpu.",
        panel=TARGET,
    )
    engine: str | None = flag(
        None,
        "Simulated engine's defaults: vllm (default on GPUs), sglang, servelab "
        "(default on cpu). --engine-args override them.",
        panel=TARGET,
    )
    dtype: str | None = flag(
        None,
        "Weights: bf16 (default on GPUs), fp16, fp8 (W8A8), int8 or int4 (weight-only).",
        panel=TARGET,
    )
    kv_dtype: str | None = flag(None, "KV cache: bf16 (default), fp16 or fp8.", panel=TARGET)
    model: str = flag(
        DEFAULT_MODEL, "Model preset, HF config.json (or its dir), or .gguf.", panel=TARGET
    )
    profile: str | None = flag(
        None, "A `servelab profile` table: replay this machine's measured step times.", panel=TARGET
    )
    calibration: str | None = flag(
        None,
        "A `servelab calibrate` file: fitted efficiencies for --hardware, or the twin "
        "of another server (calibrated on its run; no --hardware).",
        panel=TARGET,
    )
    mfu: float | None = flag(
        None, "Override the roofline's model FLOPs utilisation (0-1).", panel=TARGET
    )
    mbu: float | None = flag(
        None, "Override the roofline's memory bandwidth utilisation (0-1).", panel=TARGET
    )
    step_overhead: str | None = flag(
        None, "Override the fixed cost per step, e.g. 1ms.", panel=TARGET
    )
    load: LoadFlags = field(default_factory=LoadFlags)
    engine_args: str | None = flag(
        None,
        "Engine settings as `servelab serve` spells them, plus --tp and "
        "--gpu-memory-utilization, e.g. '--max-num-seqs 128 --no-enable-chunked-prefill --tp 2'; "
        "a twin of vLLM, SGLang or llama-server: that server's own flags.",
        panel=TARGET,
    )
    sim_seed: int = flag(
        0,
        "Seed of the simulator's own draws (step noise, speculative acceptance, resent "
        "history); repeat with others to see a simulation's spread. --seed stays the plan's.",
        panel=WORKLOAD,
    )
    sweep: list[str] | None = flag(
        None,
        "Sweep an engine arg: 'max_num_batched_tokens=512,2048' (repeatable: cross product).",
        panel=SLO_SEARCH,
    )
    replicas: int = flag(1, "Data-parallel replicas behind a router.", panel=DEPLOYMENT)
    router: str = flag(
        "round-robin", "round-robin, least-loaded or prefix-aware.", panel=DEPLOYMENT
    )
    pd: str | None = flag(
        None, "Disaggregate: 'P:D' prefill and decode replicas, e.g. 1:3.", panel=DEPLOYMENT
    )
    link: str = flag(
        "nvlink",
        "KV transfer link for --pd: nvlink, ib, roce, ethernet, pcie or '25GB/s,10us'.",
        panel=DEPLOYMENT,
    )
    network_delay: str | None = flag(
        None,
        "One-way client-server delay, e.g. 2ms (default 0; a twin: half its API time).",
        panel=DEPLOYMENT,
    )
    find_capacity: str | None = flag(
        None,
        "replicas (fewest), rate (highest) or pd (best split of --replicas).",
        panel=SLO_SEARCH,
    )
    attainment_target: float = flag(
        0.9,
        "Fraction of requests that must meet their SLOs.",
        panel=SLO_SEARCH,
        decls=("--attainment",),
    )
    max_replicas: int = flag(64, "Upper bound for --find-capacity replicas.", panel=SLO_SEARCH)
    out: str | None = flag(None, "Run directory to write (default runs/sim-<time>).", panel=OUTPUT)
    no_steps: bool = flag(
        False,
        "Do not write steps.jsonl (huge for long traces).",
        panel=OUTPUT,
        decls=("--no-steps",),
    )
    seeds: int = flag(
        1,
        "Simulate each run under this many simulator seeds (from --sim-seed) and report "
        "each figure's median and range (prediction.json).",
        panel=OUTPUT,
    )


def sim(flags: SimFlags) -> None:
    """Simulate a deployment on the engine's own scheduler with a cost model (what-ifs at GPU scale)."""
    from rich.console import Console

    from servelab.cli import held
    from servelab.sim.run import run_sim

    note_old_spelling(flags.engine_args)
    try:
        spec = sim_spec(flags)
        run_sim(spec, Console(), keep=held())
    except ValueError as e:
        raise fail(str(e)) from None


def sim_spec(flags: SimFlags) -> SimSpec:
    """The run ``flags`` ask for. Raises ValueError (or typer's BadParameter for a time it
    cannot read) naming the flag."""
    from servelab.sim.spec import (
        OutputSpec,
        SearchSpec,
        SimSpec,
        TargetSpec,
        TopologySpec,
        WorkloadSpec,
        parse_pd,
    )

    f, load = flags, flags.load
    search = spec_from_flags(SearchSpec, f, sweep=tuple(f.sweep or ()))
    target = spec_from_flags(
        TargetSpec, f, step_overhead=seconds("--step-overhead", f.step_overhead)
    )
    workload = WorkloadSpec(
        load=load.load_spec(),
        workload=load.workload,
        seed=load.seed,
        sim_seed=f.sim_seed,
        endpoint=load.endpoint,
        slo=load.slo,
    )
    topology = spec_from_flags(
        TopologySpec,
        f,
        pd=parse_pd(f.pd),
        network_delay=seconds("--network-delay", f.network_delay),
    )
    out = Path(f.out or f"runs/sim-{time.strftime('%Y%m%d-%H%M%S')}")
    return SimSpec(target, topology, workload, search, OutputSpec(out, not f.no_steps))


PANELS = (TARGET, WORKLOAD, LOAD, LENGTH, SLO_SEARCH, DEPLOYMENT, OUTPUT)
COMMANDS = {"sim": command_from_fields(SimFlags, sim, PANELS)}
