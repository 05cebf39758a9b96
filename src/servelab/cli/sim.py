"""`servelab sim`, `servelab profile` and `servelab calibrate`. No heavy imports at module level."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer

from servelab.cli.errors import fail, seconds


def _build_target(
    hardware: str | None,
    model: str,
    profile: str | None,
    calibration: str | None,
    engine_args: str | None,
    overrides: dict[str, float | None],
    engine: str | None = None,
    dtype: str | None = None,
    kv_dtype: str | None = None,
) -> Any:
    from servelab.engine.config import EngineConfig
    from servelab.sim.args import parse_engine_args, split_deployment
    from servelab.sim.calibrate import Calibration
    from servelab.sim.roofline import Efficiency
    from servelab.sim.target import profile_target, roofline_target

    eng, dep = split_deployment(parse_engine_args(engine_args))
    if profile is not None:
        if hardware is not None or calibration is not None:
            raise ValueError("--profile replaces --hardware/--calibration; give one or the other")
        if engine is not None or dtype is not None or kv_dtype is not None:
            raise ValueError(
                "--profile replays this machine's measured engine; --engine, --dtype and "
                "--kv-dtype apply to --hardware only"
            )
        from servelab.sim.profiled import ProfileTable

        table = ProfileTable.load(profile)
        base = EngineConfig(**table.meta.get("engine_config", {}))
        import dataclasses

        return profile_target(table, dataclasses.replace(base, **eng))
    if hardware is None:
        raise ValueError(
            "say what to simulate: --hardware NAME (with --model) or --profile TABLE.json"
        )
    eff = Efficiency()
    if calibration is not None:
        cal = Calibration.load(calibration)
        eff = cal.efficiency
    for k, v in overrides.items():
        if v is not None:
            setattr(eff, k, v)
    from servelab.sim.engine_defaults import default_engine
    from servelab.sim.hardware import get_hardware

    hw = get_hardware(hardware)
    return roofline_target(
        hw,
        model,
        tp=dep.get("tp", 1),
        efficiency=eff,
        gpu_memory_utilization=dep.get("gpu_memory_utilization"),
        dtype=dtype,
        kv_dtype=kv_dtype,
        engine=engine or default_engine(hw),
        engine_args=eng,
    )


def _check_fresh(d: Path) -> None:
    if (d / "requests.jsonl").exists():
        raise ValueError(
            f"{d} already holds a run (requests.jsonl); choose another --out or delete it"
        )


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


def sim(
    hardware: str | None = typer.Option(
        None, help="Hardware to simulate: h100, h200, b200, a100, a100-40gb, l4, mi300x, cpu."
    ),
    engine: str | None = typer.Option(
        None,
        help="Simulated engine's defaults: vllm (default on GPUs), sglang, servelab "
        "(default on cpu). --engine-args override them.",
    ),
    dtype: str | None = typer.Option(
        None, help="Weights: bf16 (default on GPUs), fp16, fp8 (W8A8), int8 or int4 (weight-only)."
    ),
    kv_dtype: str | None = typer.Option(None, help="KV cache: bf16 (default), fp16 or fp8."),
    model: str = typer.Option(
        "smollm2-135m", help="Model preset, HF config.json (or its dir), or .gguf."
    ),
    profile: str | None = typer.Option(
        None, help="A `servelab profile` table: replay this machine's measured step times."
    ),
    calibration: str | None = typer.Option(
        None, help="A `servelab calibrate` file: fitted efficiencies for --hardware."
    ),
    mfu: float | None = typer.Option(
        None, help="Override the roofline's model FLOPs utilisation (0-1)."
    ),
    mbu: float | None = typer.Option(
        None, help="Override the roofline's memory bandwidth utilisation (0-1)."
    ),
    step_overhead: str | None = typer.Option(
        None, help="Override the fixed cost per step, e.g. 1ms."
    ),
    workload: str | None = typer.Option(
        None, help="Workload preset or spec file (as for `servelab bench`)."
    ),
    trace: str | None = typer.Option(
        None,
        help="Replay a trace: azure-2023-conv, mooncake-synthetic, or an Azure CSV / "
        "Mooncake JSONL file.",
    ),
    rate: float | None = typer.Option(
        None, help="Open loop: requests/s (with a trace: the mean rate to scale it to)."
    ),
    concurrency: int | None = typer.Option(None, help="Closed loop: requests in flight."),
    arrival: str = typer.Option("poisson", help="poisson, gamma, constant, onoff, ramp."),
    burstiness: float = typer.Option(
        1.0, help="Gamma arrivals' shape (1 = Poisson, < 1 burstier)."
    ),
    requests: int | None = typer.Option(None, help="Stop after this many requests (sessions)."),
    duration: str | None = typer.Option(None, help="Send nothing later than this, e.g. 60s."),
    time_scale: float = typer.Option(1.0, help="Trace: multiply its times (2 = twice as slow)."),
    length_scale: float = typer.Option(1.0, help="Multiply every token length."),
    seed: int = typer.Option(0, help="Seed of the plan (the simulation itself is deterministic)."),
    sim_seed: int = typer.Option(
        0,
        help="Seed of the simulator's own draws (step noise, speculative acceptance, resent "
        "history); repeat with others to see a simulation's spread. --seed stays the plan's.",
    ),
    endpoint: str = typer.Option(
        "completions", help="completions or chat (as for `servelab bench`)."
    ),
    engine_args: str | None = typer.Option(
        None, help="Engine settings, e.g. 'max_num_seqs=128 --no-enable-chunked-prefill tp=2'."
    ),
    sweep: list[str] | None = typer.Option(  # noqa: B008
        None,
        help="Sweep an engine arg: 'max_num_batched_tokens=512,2048' (repeatable: cross product).",
    ),
    replicas: int = typer.Option(1, help="Data-parallel replicas behind a router."),
    router: str = typer.Option("round-robin", help="round-robin, least-loaded or prefix-aware."),
    pd: str | None = typer.Option(
        None, help="Disaggregate: 'P:D' prefill and decode replicas, e.g. 1:3."
    ),
    link: str = typer.Option(
        "nvlink",
        help="KV transfer link for --pd: nvlink, ib, roce, ethernet, pcie or '25GB/s,10us'.",
    ),
    network_delay: str = typer.Option("0ms", help="One-way client-server delay, e.g. 2ms."),
    slo: str | None = typer.Option(
        None, help="SLO override for every class, e.g. 'ttft=2s,itl=200ms'."
    ),
    find_capacity: str | None = typer.Option(
        None, help="replicas (fewest), rate (highest) or pd (best split of --replicas)."
    ),
    attainment_target: float = typer.Option(
        0.9, "--attainment", help="Fraction of requests that must meet their SLOs."
    ),
    max_replicas: int = typer.Option(64, help="Upper bound for --find-capacity replicas."),
    out: str | None = typer.Option(None, help="Run directory to write (default runs/sim-<time>)."),
    no_steps: bool = typer.Option(
        False, "--no-steps", help="Do not write steps.jsonl (huge for long traces)."
    ),
) -> None:
    """Simulate a deployment on the engine's own scheduler with a cost model (what-ifs at GPU scale)."""
    import json

    from rich.console import Console

    from servelab.bench.plan import LoadSpec
    from servelab.report.terminal import defaults_line, sim_table
    from servelab.rundir import read_json
    from servelab.sim.links import parse_link
    from servelab.sim.loop import Topology
    from servelab.sim.rundir import write_run_dir
    from servelab.sim.scenario import Scenario, load_requests, simulate
    from servelab.units import SLO

    try:
        target = _build_target(
            hardware,
            model,
            profile,
            calibration,
            engine_args,
            {"mfu": mfu, "mbu": mbu, "step_overhead": seconds("--step-overhead", step_overhead)},
            engine,
            dtype,
            kv_dtype,
        )
        topo = Topology(replicas=replicas, router=router)
        if pd is not None:
            p, _, d = pd.partition(":")
            if not (p.isdigit() and d.isdigit()):
                raise ValueError(f"--pd {pd!r}: write P:D, e.g. 1:3")
            topo = Topology(prefill=int(p), decode=int(d), router=router, link=parse_link(link))
        topo.validate()
        load = LoadSpec(
            concurrency=concurrency,
            rate=rate,
            arrival=arrival,
            burstiness=burstiness,
            requests=requests,
            duration=seconds("--duration", duration),
            trace=trace,
            time_scale=time_scale,
            length_scale=length_scale,
        )
        max_len = target.engine_config.max_model_len or target.max_model_len
        reqs, info, slos = load_requests(
            workload,
            load,
            seed,
            max_len,
            endpoint,
            resend=target.resend,
            sim_seed=sim_seed,
        )
        info["sim_seed"] = sim_seed
        if slo is not None:
            override = SLO.parse(slo)
            slos = {k: v.merged(override) for k, v in slos.items()} if slos else override
        scenario = Scenario(
            target,
            reqs,
            topo,
            seconds("--network-delay", network_delay) or 0.0,
            concurrency,
            slos,
            info,
            sim_seed,
        )
        if find_capacity is not None and sweep:
            raise ValueError("use --find-capacity or --sweep, not both")
    except ValueError as e:
        raise fail(str(e)) from None

    used = target.info.get("engine_defaults")
    if used is not None:
        typer.echo(defaults_line(used, target.info))
    run_dir = Path(out or f"runs/sim-{time.strftime('%Y%m%d-%H%M%S')}")
    if find_capacity is not None:
        _capacity(
            find_capacity,
            scenario,
            workload,
            load,
            seed,
            endpoint,
            attainment_target,
            max_replicas,
            replicas,
            run_dir,
        )
        return
    from servelab.sim.args import parse_sweep

    try:
        points = parse_sweep(sweep) if sweep else [{}]
    except ValueError as e:
        raise fail(str(e)) from None
    rows = []
    for point in points:
        label = ",".join(f"{k}={v}" for k, v in point.items()) or target.label
        sc = scenario
        if point:
            try:
                sc = Scenario(
                    target.with_engine_args(**point),
                    reqs,
                    topo,
                    scenario.network_delay,
                    concurrency,
                    slos,
                    info,
                    sim_seed,
                )
            except (TypeError, ValueError) as e:
                raise fail(f"sweep point {label}: {e}") from None
        d = run_dir if len(points) == 1 else run_dir / label.replace("=", "-").replace(",", "_")
        try:
            _check_fresh(d)
        except ValueError as e:
            raise fail(str(e)) from None
        t0 = time.perf_counter()
        res = simulate(sc, keep_steps=not no_steps)
        wall = time.perf_counter() - t0
        write_run_dir(
            d,
            res,
            target=sc.target.describe(),
            workload=info.get("workload"),
            load=info.get("load"),
            slos=slos,
            write_steps=not no_steps,
            sim={
                "network_delay_s": sc.network_delay,
                "wall_s": wall,
                "sweep_point": point,
                "trace": info.get("trace"),
                "plan": info.get("plan"),
                "sim_seed": sim_seed,
            },
        )
        rows.append(_summary_row(label, res, read_json(d, "metrics.json") or {}, wall))
        typer.echo(f"wrote {d}")
    Console().print(sim_table(rows))
    if len(rows) > 1:
        (run_dir / "sweep.json").write_text(json.dumps(rows, indent=1))


def _capacity(
    kind: str,
    scenario: Any,
    workload: str | None,
    load: Any,
    seed: int,
    endpoint: str,
    target: float,
    max_replicas: int,
    replicas: int,
    run_dir: Path,
) -> None:
    import json

    from servelab.sim.capacity import find_capacity

    try:
        result, what = find_capacity(
            kind, scenario, workload, load, seed, endpoint, target, max_replicas, replicas
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
    run_dir: str = typer.Argument(
        ..., help="A run directory of a servelab server on the target hardware."
    ),
    hardware: str = typer.Option(
        ..., help="The catalogue entry the run's hardware is (e.g. cpu, h100)."
    ),
    model: str = typer.Option("smollm2-135m", help="The model that served the run."),
    tp: int = typer.Option(1, help="Tensor parallel degree of the run."),
    out: str = typer.Option("calibration.json", help="Where to write the fitted efficiencies."),
) -> None:
    """Fit the roofline's efficiencies and fixed costs to a measured run; report the fit error."""
    import json

    from servelab.rundir import load_run
    from servelab.sim.calibrate import fit_efficiency
    from servelab.sim.hardware import get_hardware
    from servelab.sim.modelspec import load_model_spec
    from servelab.sim.replay import measured_steps

    try:
        cal = fit_efficiency(
            load_model_spec(model), get_hardware(hardware), measured_steps(load_run(run_dir)), tp=tp
        )
    except ValueError as e:
        raise fail(str(e)) from None
    cal.save(out)
    typer.echo(json.dumps({"efficiency": cal.efficiency.to_dict(), "fit": cal.fit}, indent=1))
    typer.echo(f"wrote {out}; use it with `servelab sim --hardware {hardware} --calibration {out}`")


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
        None, help="Engine settings recorded with the table (e.g. kv_cache_memory=2G)."
    ),
    from_run: list[str] | None = typer.Option(  # noqa: B008
        None, help="Build the table from these real runs' steps instead of a grid (repeatable)."
    ),
    quantization: str = typer.Option(
        "none",
        "--quantization",
        help="Weights as `servelab serve --quantization` runs them: none (fp32) or q4_1.",
    ),
) -> None:
    """Measure the real engine's step times on this machine; `servelab sim --profile` replays them."""
    from servelab.engine.config import EngineConfig
    from servelab.sim.args import parse_engine_args, split_deployment
    from servelab.sim.profiled import ProfiledCostModel
    from servelab.sim.profiler import profile as run_profile
    from servelab.sim.profiler import table_from_runs
    from servelab.vocab import check_quantization

    try:
        check_quantization(quantization)
        eng, _ = split_deployment(parse_engine_args(engine_args))
        if from_run and quantization != "none":
            raise ValueError(
                "--from-run takes the weights' mode from the runs' servers; drop --quantization"
            )
        if from_run:
            table = table_from_runs(from_run, model)
        else:
            if repeats < 1:
                raise ValueError("--repeats must be >= 1")

            def show(k: int, n: int, shape: list, t: float) -> None:
                pre = [f"{a}@{c}" for a, c in shape if a > 1]
                dec = [c for a, c in shape if a == 1]
                what = " + ".join(
                    ([f"prefill {'+'.join(pre)}"] if pre else [])
                    + ([f"decode {len(dec)} @ctx {max(dec)}"] if dec else [])
                )
                typer.echo(f"[{k}/{n}] {what}: {t * 1000:.1f} ms")

            table = run_profile(
                model, EngineConfig(**eng), grid, repeats, device, threads, show, quantization
            )
        fitted = ProfiledCostModel(table)
    except ValueError as e:
        raise fail(str(e)) from None
    table.save(out)
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
        f"{fitted.fit_error:.1%}; use it with `servelab sim --profile {out}`"
    )


def register(app: typer.Typer) -> None:
    """Add this subsystem's commands to the `servelab` app."""
    app.command()(sim)
    app.command()(calibrate)
    app.command()(profile)
