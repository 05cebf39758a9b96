"""`servelab sim`, `servelab profile` and `servelab calibrate`. No heavy imports at module level.

`sim` is parse -> spec -> call: typer parses the options (the workload and load ones shared
with `servelab bench`, from ``servelab.cli.load_options``), ``_scenario`` builds the target,
the topology and the requests, and each sweep point (or the capacity search) simulates it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from servelab.cli import load_options as opt
from servelab.cli.errors import fail, seconds
from servelab.cli.extras import require_engine

if TYPE_CHECKING:
    from servelab.bench.workloads.request_plan import LoadSpec
    from servelab.sim.scenario import Scenario
    from servelab.sim.sim_target import SimTarget

_DEPLOYMENT = "Deployment"

Hardware = Annotated[
    str | None,
    typer.Option(
        help="Hardware to simulate: h100, h200, b200, a100, a100-40gb, l4, mi300x, cpu.",
        rich_help_panel=opt.TARGET,
    ),
]
Engine = Annotated[
    str | None,
    typer.Option(
        help="Simulated engine's defaults: vllm (default on GPUs), sglang, servelab "
        "(default on cpu). --engine-args override them.",
        rich_help_panel=opt.TARGET,
    ),
]
Dtype = Annotated[
    str | None,
    typer.Option(
        help="Weights: bf16 (default on GPUs), fp16, fp8 (W8A8), int8 or int4 (weight-only).",
        rich_help_panel=opt.TARGET,
    ),
]
KvDtype = Annotated[
    str | None,
    typer.Option(help="KV cache: bf16 (default), fp16 or fp8.", rich_help_panel=opt.TARGET),
]
Model = Annotated[
    str,
    typer.Option(
        help="Model preset, HF config.json (or its dir), or .gguf.", rich_help_panel=opt.TARGET
    ),
]
Profile = Annotated[
    str | None,
    typer.Option(
        help="A `servelab profile` table: replay this machine's measured step times.",
        rich_help_panel=opt.TARGET,
    ),
]
CalibrationFile = Annotated[
    str | None,
    typer.Option(
        help="A `servelab calibrate` file: fitted efficiencies for --hardware, or the twin "
        "of another server (calibrated on its run; no --hardware).",
        rich_help_panel=opt.TARGET,
    ),
]
Mfu = Annotated[
    float | None,
    typer.Option(
        help="Override the roofline's model FLOPs utilisation (0-1).", rich_help_panel=opt.TARGET
    ),
]
Mbu = Annotated[
    float | None,
    typer.Option(
        help="Override the roofline's memory bandwidth utilisation (0-1).",
        rich_help_panel=opt.TARGET,
    ),
]
StepOverhead = Annotated[
    str | None,
    typer.Option(help="Override the fixed cost per step, e.g. 1ms.", rich_help_panel=opt.TARGET),
]
EngineArgs = Annotated[
    str | None,
    typer.Option(
        help="Engine settings as `servelab serve` spells them, plus --tp and "
        "--gpu-memory-utilization, e.g. '--max-num-seqs 128 --no-enable-chunked-prefill --tp 2'.",
        rich_help_panel=opt.TARGET,
    ),
]
SimSeed = Annotated[
    int,
    typer.Option(
        help="Seed of the simulator's own draws (step noise, speculative acceptance, resent "
        "history); repeat with others to see a simulation's spread. --seed stays the plan's.",
        rich_help_panel=opt.WORKLOAD,
    ),
]
Replicas = Annotated[
    int, typer.Option(help="Data-parallel replicas behind a router.", rich_help_panel=_DEPLOYMENT)
]
Router = Annotated[
    str,
    typer.Option(help="round-robin, least-loaded or prefix-aware.", rich_help_panel=_DEPLOYMENT),
]
Pd = Annotated[
    str | None,
    typer.Option(
        help="Disaggregate: 'P:D' prefill and decode replicas, e.g. 1:3.",
        rich_help_panel=_DEPLOYMENT,
    ),
]
Link = Annotated[
    str,
    typer.Option(
        help="KV transfer link for --pd: nvlink, ib, roce, ethernet, pcie or '25GB/s,10us'.",
        rich_help_panel=_DEPLOYMENT,
    ),
]
NetworkDelay = Annotated[
    str | None,
    typer.Option(
        help="One-way client-server delay, e.g. 2ms (default 0; a twin: half its API time).",
        rich_help_panel=_DEPLOYMENT,
    ),
]
Seeds = Annotated[
    int,
    typer.Option(
        help="Simulate each run under this many simulator seeds (from --sim-seed) and report "
        "each figure's median and range (prediction.json).",
        rich_help_panel=opt.OUTPUT,
    ),
]
Sweep = Annotated[
    list[str] | None,
    typer.Option(
        help="Sweep an engine arg: 'max_num_batched_tokens=512,2048' (repeatable: cross product).",
        rich_help_panel=opt.SLO_SEARCH,
    ),
]
FindCapacity = Annotated[
    str | None,
    typer.Option(
        help="replicas (fewest), rate (highest) or pd (best split of --replicas).",
        rich_help_panel=opt.SLO_SEARCH,
    ),
]
Attainment = Annotated[
    float,
    typer.Option(
        "--attainment",
        help="Fraction of requests that must meet their SLOs.",
        rich_help_panel=opt.SLO_SEARCH,
    ),
]
MaxReplicas = Annotated[
    int,
    typer.Option(help="Upper bound for --find-capacity replicas.", rich_help_panel=opt.SLO_SEARCH),
]
Out = Annotated[
    str | None,
    typer.Option(
        help="Run directory to write (default runs/sim-<time>).", rich_help_panel=opt.OUTPUT
    ),
]
NoSteps = Annotated[
    bool,
    typer.Option(
        "--no-steps",
        help="Do not write steps.jsonl (huge for long traces).",
        rich_help_panel=opt.OUTPUT,
    ),
]


def sim(
    ctx: typer.Context,
    hardware: Hardware = None,
    engine: Engine = None,
    dtype: Dtype = None,
    kv_dtype: KvDtype = None,
    model: Model = "smollm2-135m",
    profile: Profile = None,
    calibration: CalibrationFile = None,
    mfu: Mfu = None,
    mbu: Mbu = None,
    step_overhead: StepOverhead = None,
    workload: opt.Workload = None,
    trace: opt.Trace = None,
    rate: opt.Rate = None,
    concurrency: opt.Concurrency = None,
    arrival: opt.Arrival = "poisson",
    burstiness: opt.Burstiness = 1.0,
    on_off: opt.OnOff = None,
    ramp_to: opt.RampTo = None,
    ramp_over: opt.RampOver = None,
    requests: opt.Requests = None,
    duration: opt.Duration = None,
    time_scale: opt.TimeScale = 1.0,
    length_scale: opt.LengthScale = 1.0,
    seed: opt.Seed = 0,
    sim_seed: SimSeed = 0,
    endpoint: opt.Endpoint = "completions",
    engine_args: EngineArgs = None,
    sweep: Sweep = None,
    replicas: Replicas = 1,
    router: Router = "round-robin",
    pd: Pd = None,
    link: Link = "nvlink",
    network_delay: NetworkDelay = None,
    slo: opt.Slo = None,
    find_capacity: FindCapacity = None,
    attainment_target: Attainment = 0.9,
    max_replicas: MaxReplicas = 64,
    out: Out = None,
    no_steps: NoSteps = False,
    seeds: Seeds = 1,
) -> None:
    """Simulate a deployment on the engine's own scheduler with a cost model (what-ifs at GPU scale)."""
    import json

    from rich.console import Console

    from servelab.report.terminal import defaults_line, sim_table
    from servelab.sim.engine_args import parse_sweep

    _note_old_spelling(engine_args)
    try:
        if find_capacity is not None and sweep:
            raise ValueError("use --find-capacity or --sweep, not both")
        if seeds < 1:
            raise ValueError("--seeds must be >= 1")
        load = opt.load_spec(ctx.params)
        scenario = _scenario(ctx.params, load)
        points = parse_sweep(sweep) if sweep else [{}]
    except ValueError as e:
        raise fail(str(e)) from None
    used = scenario.target.info.get("engine_defaults")
    if used is not None:
        typer.echo(defaults_line(used, scenario.target.info))
    run_dir = Path(out or f"runs/sim-{time.strftime('%Y%m%d-%H%M%S')}")
    if find_capacity is not None:
        _capacity(ctx.params, scenario, load, run_dir)
        return
    rows = [_simulate_point(scenario, p, run_dir, len(points) > 1, not no_steps) for p in points]
    if seeds > 1:
        for p in points:
            _intervals(
                ctx.params, scenario, p, range(sim_seed, sim_seed + seeds), run_dir, len(points) > 1
            )
    Console().print(sim_table(rows))
    if len(rows) > 1:
        (run_dir / "sweep.json").write_text(json.dumps(rows, indent=1))


def _note_old_spelling(engine_args: str | None) -> None:
    """One line on stderr when ``--engine-args`` uses the old ``key=value`` spelling."""
    from servelab.sim.engine_args import respell

    try:
        new = respell(engine_args)
    except ValueError:
        return  # the command reports the bad setting itself
    if new is not None:
        typer.echo(f"note: key=value is the old spelling; write --engine-args {new!r}", err=True)


def _target(flags: Mapping[str, Any], draw: int = 0) -> SimTarget:
    """What to simulate: another server's twin (``draw`` picks its bootstrap refit and speed),
    a measured profile, or hardware x model through the roofline."""
    from servelab.engine.engine_config import EngineConfig
    from servelab.sim.costs.roofline import Efficiency
    from servelab.sim.engine_args import parse_engine_args, split_deployment
    from servelab.sim.fit.calibrate import Calibration
    from servelab.sim.fit.twin import TwinCalibration, is_twin_file
    from servelab.sim.sim_target import profile_target, roofline_target

    eng, dep = split_deployment(parse_engine_args(flags["engine_args"]))
    if flags["calibration"] is not None and is_twin_file(flags["calibration"]):
        given = ("hardware", "profile", "engine", "dtype", "kv_dtype", "mfu", "mbu")
        if any(flags[k] is not None for k in (*given, "step_overhead")):
            raise ValueError(
                "a twin calibration is the measured server itself: drop --hardware, "
                "--profile, --engine, --dtype, --kv-dtype and the efficiency overrides"
            )
        return TwinCalibration.load(flags["calibration"]).target(draw).with_engine_args(**eng)
    if flags["profile"] is not None:
        if flags["hardware"] is not None or flags["calibration"] is not None:
            raise ValueError("--profile replaces --hardware/--calibration; give one or the other")
        if any(flags[k] is not None for k in ("engine", "dtype", "kv_dtype")):
            raise ValueError(
                "--profile replays this machine's measured engine; --engine, --dtype and "
                "--kv-dtype apply to --hardware only"
            )
        from servelab.sim.costs.profiled import ProfileTable

        table = ProfileTable.load(flags["profile"])
        base = EngineConfig(**table.meta.get("engine_config", {}))
        return profile_target(table, dataclasses.replace(base, **eng))
    if flags["hardware"] is None:
        raise ValueError(
            "say what to simulate: --hardware NAME (with --model) or --profile TABLE.json"
        )
    eff = Efficiency()
    if flags["calibration"] is not None:
        eff = Calibration.load(flags["calibration"]).efficiency
    overrides = {
        "mfu": flags["mfu"],
        "mbu": flags["mbu"],
        "step_overhead": seconds("--step-overhead", flags["step_overhead"]),
    }
    for k, v in overrides.items():
        if v is not None:
            setattr(eff, k, v)
    from servelab.sim.costs.hardware import get_hardware
    from servelab.sim.engine_defaults import default_engine

    hw = get_hardware(flags["hardware"])
    return roofline_target(
        hw,
        flags["model"],
        tp=dep.get("tp", 1),
        efficiency=eff,
        gpu_memory_utilization=dep.get("gpu_memory_utilization"),
        dtype=flags["dtype"],
        kv_dtype=flags["kv_dtype"],
        engine=flags["engine"] or default_engine(hw),
        engine_args=eng,
    )


def _topology(flags: Mapping[str, Any]) -> Any:
    from servelab.sim.loop.links import parse_link
    from servelab.sim.loop.simulation import Topology

    topo = Topology(replicas=flags["replicas"], router=flags["router"])
    if flags["pd"] is not None:
        p, _, d = flags["pd"].partition(":")
        if not (p.isdigit() and d.isdigit()):
            raise ValueError(f"--pd {flags['pd']!r}: write P:D, e.g. 1:3")
        topo = Topology(
            prefill=int(p), decode=int(d), router=flags["router"], link=parse_link(flags["link"])
        )
    topo.validate()
    return topo


def _scenario(flags: Mapping[str, Any], load: LoadSpec) -> Scenario:
    """The target, topology and requests of ``load`` that the parsed ``flags`` ask for
    (ValueError if they cannot be)."""
    from servelab.sim.scenario import Scenario, load_requests
    from servelab.units import SLO

    target = _target(flags)
    target.engine_config.validate()  # a bad --engine-args value is the user's to fix
    topology = _topology(flags)
    reqs, info, slos = load_requests(
        _workload(flags),
        load,
        flags["seed"],
        target.engine_config.max_model_len or target.max_model_len,
        flags["endpoint"],
        resend=target.resend,
        sim_seed=flags["sim_seed"],
    )
    info["sim_seed"] = flags["sim_seed"]
    info["endpoint"] = flags["endpoint"]
    delay = seconds("--network-delay", flags["network_delay"])
    if delay is None:  # a twin's clients sit half its measured API time away
        delay = float(target.info.get("api_overhead_s") or 0.0) / 2
    if flags["slo"] is not None:
        override = SLO.parse(flags["slo"])
        slos = {k: v.merged(override) for k, v in slos.items()} if slos else override
    return Scenario(
        target=target,
        requests=reqs,
        topology=topology,
        network_delay=delay,
        max_concurrency=load.concurrency,
        slos=slos,
        info=info,
        sim_seed=flags["sim_seed"],
    )


def _workload(flags: Mapping[str, Any]) -> str | None:
    """``--workload``, or bench's default one where neither it nor a trace is given."""
    if flags["workload"] is not None or flags["trace"] is not None:
        return flags["workload"]
    from servelab.bench.run import DEFAULT_WORKLOAD

    return DEFAULT_WORKLOAD


def _simulate_point(
    scenario: Scenario, point: dict[str, Any], out: Path, in_sweep: bool, write_steps: bool
) -> dict[str, Any]:
    """Simulate ``scenario`` with the engine settings of one sweep point into ``out`` (in a
    sweep: a directory under it named for the point); return its row of the terminal table."""
    from servelab.rundir import read_json
    from servelab.sim.run_writer import write_run_dir
    from servelab.sim.scenario import simulate

    label, run_dir = _point_dir(scenario, point, out, in_sweep)
    try:
        if point:
            scenario = dataclasses.replace(
                scenario, target=scenario.target.with_engine_args(**point)
            )
            scenario.target.engine_config.validate()
    except (TypeError, ValueError) as e:
        raise fail(f"sweep point {label}: {e}") from None
    if (run_dir / "requests.jsonl").exists():
        raise fail(
            f"{run_dir} already holds a run (requests.jsonl); choose another --out or delete it"
        )
    t0 = time.perf_counter()
    res = simulate(scenario, keep_steps=write_steps)
    wall = time.perf_counter() - t0
    info = scenario.info
    write_run_dir(
        run_dir,
        res,
        target=scenario.target.describe(),
        workload=info.get("workload"),
        load=info.get("load"),
        slos=scenario.slos,
        write_steps=write_steps,
        sim={
            "network_delay_s": scenario.network_delay,
            "wall_s": wall,
            "sweep_point": point,
            "trace": info.get("trace"),
            "plan": info.get("plan"),
            "sim_seed": scenario.sim_seed,
            "seed": info.get("seed"),
            "endpoint": info.get("endpoint"),
        },
    )
    typer.echo(f"wrote {run_dir}")
    return _summary_row(label, res, read_json(run_dir, "metrics.json") or {}, wall)


def _point_dir(
    scenario: Scenario, point: dict[str, Any], out: Path, in_sweep: bool
) -> tuple[str, Path]:
    """A sweep point's label and run directory (``out`` itself outside a sweep)."""
    label = ",".join(f"{k}={v}" for k, v in point.items()) or scenario.target.label
    return label, out / label.replace("=", "-").replace(",", "_") if in_sweep else out


def _intervals(
    flags: Mapping[str, Any],
    scenario: Scenario,
    point: dict[str, Any],
    seeds: range,
    out: Path,
    in_sweep: bool,
) -> None:
    """Repeat one simulated run (a sweep point) over more seeds; print and write each
    figure's range beside the run written for the first seed."""
    import json

    from rich.console import Console

    from servelab.report.twin_tables import prediction_table
    from servelab.sim.intervals import predict

    def scenario_for(seed: int) -> Any:
        target = _target(flags, seed).with_engine_args(**point)
        return dataclasses.replace(scenario, target=target, sim_seed=seed)

    label, run_dir = _point_dir(scenario, point, out, in_sweep)
    pred = predict(scenario_for, list(seeds))
    (run_dir / "prediction.json").write_text(json.dumps(pred.to_dict(), indent=1))
    title = f"{label}: median and range over {len(pred.seeds)} seeds"
    Console().print(prediction_table(pred, title))


def _summary_row(label: str, res: Any, metrics: dict[str, Any], wall: float) -> dict[str, Any]:
    """The sweep table's row: ``summarize``'s figures over the measured window (the run's
    metrics.json) and what only the simulation knows (steps, preemptions, times)."""
    o = metrics["overall"]
    lat = o["latency"]
    return {
        "label": label,
        "requests": o["requests"]["sent"],
        "failed": o["requests"]["failed"],
        **{f"{m}_{p}": lat[m][p] for m in ("ttft", "itl", "e2e") for p in ("p50", "p95")},
        "output_tok_s": o["throughput"]["output_tokens_per_s"],
        "slo_attainment": o["goodput"]["fraction"],
        "preemptions": sum(r["stats"]["num_preemptions"] for r in res.replicas),
        "steps": res.num_steps,
        "sim_s": res.sim_duration,
        "wall_s": wall,
    }


def _capacity(flags: Mapping[str, Any], scenario: Scenario, load: LoadSpec, run_dir: Path) -> None:
    import json

    from servelab.sim.capacity import find_capacity

    kind, target = flags["find_capacity"], flags["attainment_target"]
    try:
        result, what = find_capacity(
            kind,
            scenario,
            _workload(flags),
            load,
            flags["seed"],
            flags["endpoint"],
            target,
            flags["max_replicas"],
            flags["replicas"],
        )
    except ValueError as e:
        raise fail(str(e)) from None
    for p in result.points:
        typer.echo(
            f"  {p.label:>16}: SLO attainment {p.attainment:.3f}, goodput {p.goodput:.3g} req/s"
            f"{'  meets' if p.meets else ''}"
        )
    answer = result.answer
    typer.echo(
        f"{what} meeting {target:.0%} SLO attainment: "
        f"{answer if answer is not None else 'none within the searched range'}"
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "capacity.json").write_text(
        json.dumps({"search": kind, **result.to_dict()}, indent=1)
    )
    typer.echo(f"wrote {run_dir / 'capacity.json'}")


def calibrate(
    run_dirs: list[str] = typer.Argument(  # noqa: B008
        ...,
        help="A run directory: of a servelab server on the target hardware, or of another "
        "server (vLLM, SGLang, llama.cpp), whose twin is fitted from its client timestamps; "
        "several runs of that server in one configuration (e.g. before and after a restart) "
        "make the twin's ranges carry how far its speed moves between runs.",
    ),
    hardware: str | None = typer.Option(
        None,
        help="The catalogue entry the run's hardware is (e.g. cpu, h100); required for a "
        "servelab run, the engine's hardware defaults for another server's.",
    ),
    model: str | None = typer.Option(
        None,
        help="The model that served the run (default smollm2-135m; another server's: its own).",
    ),
    tp: int = typer.Option(1, help="Tensor parallel degree of the run."),
    server_config: str | None = typer.Option(
        None,
        help="Another server's launch command or flags, e.g. 'vllm serve M "
        "--no-enable-chunked-prefill', where the run did not record them.",
    ),
    out: str = typer.Option("calibration.json", help="Where to write the fitted efficiencies."),
) -> None:
    """Fit the roofline's efficiencies and fixed costs to a measured run, or a twin of another
    server to its runs' client timestamps; report the fit error."""
    import json

    from servelab.rundir import RunDirError, load_run
    from servelab.sim.costs.hardware import get_hardware
    from servelab.sim.costs.model_shapes import load_model_spec
    from servelab.sim.fit.calibrate import fit_efficiency
    from servelab.sim.fit.recorded_steps import measured_steps

    try:
        runs = [load_run(d) for d in run_dirs]
        run = runs[0]
        if not run.steps and not run.simulated:
            _calibrate_twin(runs, hardware, model, server_config, out)
            return
        if len(runs) > 1:
            raise ValueError("give one servelab run: several runs calibrate another server's twin")
        if hardware is None:
            raise ValueError("--hardware: say which catalogue entry the run's hardware is")
        cal = fit_efficiency(
            load_model_spec(model or "smollm2-135m"),
            get_hardware(hardware),
            measured_steps(run),
            tp=tp,
        )
    except (RunDirError, ValueError) as e:
        raise fail(str(e)) from None
    cal.save(out)
    typer.echo(json.dumps({"efficiency": cal.efficiency.to_dict(), "fit": cal.fit}, indent=1))
    typer.echo(f"wrote {out}; use it with `servelab sim --hardware {hardware} --calibration {out}`")


def _calibrate_twin(
    runs: list[Any], hardware: str | None, model: str | None, server_config: str | None, out: str
) -> None:
    import dataclasses
    import shlex

    from rich.console import Console

    from servelab.bench.manifest import redact
    from servelab.report.twin_tables import calibration_table
    from servelab.sim.fit.twin import calibrate_runs

    stated = shlex.join(redact(shlex.split(server_config))) if server_config else None
    cal = calibrate_runs(runs, stated, hardware, model)
    cal.save(out)
    Console().print(calibration_table(dataclasses.asdict(cal)))
    typer.echo(
        f"wrote {out}; predict with `servelab sim --calibration {out} --workload W "
        "--rate R --seeds 8` (--engine-args for other settings)"
    )


def profile(
    model: str = typer.Option(
        "smollm2-135m", help="Model to profile (short name, .gguf or HF dir)."
    ),
    out: str = typer.Option("profile.json", help="Where to write the profile table."),
    grid: str = typer.Option("default", help="default (about 70 shapes, minutes) or quick."),
    repeats: int = typer.Option(
        2, help="Timed runs per shape (after one warm-up); the median is kept."
    ),
    threads: int | None = typer.Option(
        None, help="Torch/BLAS threads (default: what `servelab serve` uses, all cores but one)."
    ),
    device: str | None = typer.Option(None, help="cpu or cuda (default: the loader's choice)."),
    engine_args: str | None = typer.Option(
        None, help="Engine settings recorded with the table (e.g. '--kv-cache-memory 2G')."
    ),
    from_run: list[str] | None = typer.Option(  # noqa: B008
        None, help="Build the table from these real runs' steps instead of a grid (repeatable)."
    ),
    quantization: str = typer.Option(
        "none",
        "--quantization",
        help="Weights as `servelab serve --quantization` runs them: none (fp32), bf16 or q4_1.",
    ),
) -> None:
    """Measure the real engine's step times on this machine; `servelab sim --profile` replays them."""
    require_engine("profile")
    from servelab.engine.engine_config import EngineConfig
    from servelab.sim.costs.profiled import ProfiledCostModel
    from servelab.sim.engine_args import parse_engine_args, split_deployment
    from servelab.sim.fit.run_profile import table_from_runs
    from servelab.vocab import check_quantization
    from servelab.workflows.profile import profile as run_profile

    _note_old_spelling(engine_args)
    try:
        check_quantization(quantization)
        eng, _ = split_deployment(parse_engine_args(engine_args))
        if from_run and quantization != "none":
            raise ValueError(
                "--from-run takes the weights' mode from the runs' servers; drop --quantization"
            )
        if from_run:
            table = table_from_runs(from_run, model)
        elif repeats < 1:
            raise ValueError("--repeats must be >= 1")
        else:
            config = EngineConfig(**eng)
            table = run_profile(
                model, config, grid, repeats, device, threads, _show_shape, quantization
            )
        fitted = ProfiledCostModel(table)
    except ValueError as e:
        raise fail(str(e)) from None
    table.save(out)
    _describe_table(table, out, fitted.fit_error)


def _show_shape(k: int, n: int, shape: list, t: float) -> None:
    """One line per profiled shape: its prefills (tokens@context) and decodes, and its time."""
    pre = [f"{a}@{c}" for a, c in shape if a > 1]
    dec = [c for a, c in shape if a == 1]
    what = " + ".join(
        ([f"prefill {'+'.join(pre)}"] if pre else [])
        + ([f"decode {len(dec)} @ctx {max(dec)}"] if dec else [])
    )
    typer.echo(f"[{k}/{n}] {what}: {t * 1000:.1f} ms")


def _describe_table(table: Any, out: str, fit_error: float) -> None:
    if table.meta.get("shapes_left_out"):
        typer.echo(
            f"left out {len(table.meta['shapes_left_out'])} shapes whose contexts the KV pool "
            "cannot hold at once (listed in the table's meta.shapes_left_out)"
        )
    if table.meta.get("run_speeds"):
        speeds = ", ".join(f"{f:.2f}" for f in table.meta["run_speeds"])
        typer.echo(
            f"the runs' speeds on one-sequence decodes: {speeds} of their mean (machine "
            "drift; the profile prices their mean; meta.run_speeds)"
        )
    typer.echo(
        f"wrote {out}: {len(table.samples)} steps of {table.meta.get('quantization', 'none')} "
        "weights, interpolation error median "
        f"{fit_error:.1%}; use it with `servelab sim --profile {out}`"
    )


COMMANDS = {"sim": sim, "calibrate": calibrate, "profile": profile}
