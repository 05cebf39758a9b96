"""`servelab sim` below the CLI: ``run_sim(spec, console)`` builds the target, the topology
and the requests a ``SimSpec`` asks for, simulates each sweep point (or runs the capacity
search), writes the run directories and prints what the command prints.

Raises ValueError, with a message naming the flag, for a spec it cannot carry out.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from servelab.sim.fit.twin import TwinCalibration
    from servelab.sim.loop.simulation import Topology
    from servelab.sim.scenario import Scenario
    from servelab.sim.sim_target import SimTarget
    from servelab.sim.spec import SimSpec, TargetSpec, TopologySpec


def say(console: Console, text: str) -> None:
    """One plain line, as ``print`` writes it (no markup, no wrapping)."""
    console.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True)


def run_sim(spec: SimSpec, console: Console, keep: list[object] | None = None) -> None:
    """Simulate ``spec``: each sweep point into its run directory and one table of them, or
    the capacity search into ``capacity.json``. ``keep``, when given, receives the scenario
    and, for one run (no sweep, one seed), the simulated result, which then outlive the
    call (the CLI ends its process without freeing them: ``cli.held_to_exit``)."""
    from servelab.report.terminal import defaults_line, sim_table
    from servelab.sim.engine_args import parse_sweep
    from servelab.sim.loop.simulation import cyclic_gc_paused

    with cyclic_gc_paused():  # a trace's requests: lists of ids the collector walked for nothing
        scenario = build_scenario(spec)
    if keep is not None:
        keep.append(scenario)
    points = parse_sweep(list(spec.search.sweep)) if spec.search.sweep else [{}]
    used = scenario.target.info.get("engine_defaults")
    if used is not None:
        say(console, defaults_line(used, scenario.target.info))
    for note in scenario.info.get("notes", []):
        say(console, note)
    out = spec.output.out
    if spec.search.find_capacity is not None:
        _capacity(spec, scenario, console)
        return
    in_sweep = len(points) > 1
    # a sweep or more seeds free each result before simulating again: held, they would add up
    held = keep if not in_sweep and spec.search.seeds == 1 else None
    rows = [_simulate_point(scenario, p, spec, in_sweep, console, held) for p in points]
    if spec.search.seeds > 1:
        first = spec.workload.sim_seed
        for p in points:
            seeds = range(first, first + spec.search.seeds)
            _intervals(spec, scenario, p, seeds, in_sweep, console)
    console.print(sim_table(rows))
    if len(rows) > 1:
        (out / "sweep.json").write_text(json.dumps(rows, indent=1))


def sim_target(spec: TargetSpec, draw: int = 0) -> SimTarget:
    """What to simulate: another server's twin (``draw`` picks its bootstrap refit and speed),
    a measured profile, or hardware x model through the roofline."""
    from servelab.engine.engine_config import EngineConfig
    from servelab.sim.costs.roofline import Efficiency
    from servelab.sim.engine_args import parse_engine_args, split_deployment
    from servelab.sim.fit.calibrate import Calibration
    from servelab.sim.fit.twin import TwinCalibration, is_twin_file
    from servelab.sim.sim_target import profile_target, roofline_target

    if spec.calibration is not None and is_twin_file(spec.calibration):
        if spec.roofline_given():
            raise ValueError(
                "a twin calibration is the measured server itself: drop --hardware, "
                "--profile, --engine, --dtype, --kv-dtype and the efficiency overrides"
            )
        twin = TwinCalibration.load(spec.calibration)
        return twin.target(draw).with_engine_args(**twin_engine_args(twin, spec.engine_args))
    eng, dep = split_deployment(parse_engine_args(spec.engine_args))
    if spec.profile is not None:
        if spec.hardware is not None or spec.calibration is not None:
            raise ValueError("--profile replaces --hardware/--calibration; give one or the other")
        if any(v is not None for v in (spec.engine, spec.dtype, spec.kv_dtype)):
            raise ValueError(
                "--profile replays this machine's measured engine; --engine, --dtype and "
                "--kv-dtype apply to --hardware only"
            )
        from servelab.sim.costs.profiled import ProfileTable

        table = ProfileTable.load(spec.profile)
        base = EngineConfig(**table.meta.get("engine_config", {}))
        return profile_target(table, dataclasses.replace(base, **eng))
    if spec.hardware is None:
        raise ValueError(
            "say what to simulate: --hardware NAME (with --model) or --profile TABLE.json"
        )
    from servelab.sim.costs.hardware import get_hardware
    from servelab.sim.engine_defaults import default_engine, engine_defaults

    hw = get_hardware(spec.hardware)
    engine = spec.engine or default_engine(hw)
    tp = dep.get("tp", 1)
    # None keeps the engine preset's own step costs (fitted to real runs for vLLM on GPUs); a
    # calibration replaces them, and each override changes one of whichever applies.
    eff = Calibration.load(spec.calibration).efficiency if spec.calibration is not None else None
    overrides = {"mfu": spec.mfu, "mbu": spec.mbu, "step_overhead": spec.step_overhead}
    given = {k: v for k, v in overrides.items() if v is not None}
    if given:
        start = eff or engine_defaults(engine, hw, tp).efficiency or Efficiency()
        eff = dataclasses.replace(start, **given)
    return roofline_target(
        hw,
        spec.model,
        tp=tp,
        efficiency=eff,
        gpu_memory_utilization=dep.get("gpu_memory_utilization"),
        dtype=spec.dtype,
        kv_dtype=spec.kv_dtype,
        engine=engine,
        engine_args=eng,
    )


def twin_engine_args(twin: TwinCalibration, text: str | None) -> dict[str, Any]:
    """``--engine-args`` for a twin: in its server's own spelling where servelab knows that
    server's flags (``sim.fit.twin.server_engine_args``), else in `servelab serve`'s."""
    from servelab.analyze.server_side.serversettings import FLAGS
    from servelab.sim.engine_args import parse_engine_args, split_deployment
    from servelab.sim.fit.twin import server_engine_args

    if twin.server in FLAGS:
        return server_engine_args(twin, text)
    eng, dep = split_deployment(parse_engine_args(text))
    if dep:
        raise ValueError(f"a twin is one measured server: drop {', '.join(sorted(dep))}")
    return eng


def _topology(spec: TopologySpec) -> Topology:
    from servelab.sim.loop.links import parse_link
    from servelab.sim.loop.simulation import Topology

    topo = Topology(replicas=spec.replicas, router=spec.router)
    if spec.pd is not None:
        p, d = spec.pd
        topo = Topology(prefill=p, decode=d, router=spec.router, link=parse_link(spec.link))
    topo.validate()
    return topo


def build_scenario(spec: SimSpec, target: SimTarget | None = None) -> Scenario:
    """The target, topology and requests ``spec`` asks for (ValueError if they cannot be).
    ``target``: one already built in place of ``spec.target``'s (a twin held in memory, as
    a leave-one-run-out fold's), so that it is simulated exactly as `servelab sim` would."""
    from servelab.sim.scenario import Scenario, is_run_dir, load_requests, requests_from_run
    from servelab.units import SLO

    target = target or sim_target(spec.target)
    target.engine_config.validate()  # a bad --engine-args value is the user's to fix
    topology = _topology(spec.topology)
    wl = spec.workload
    slos: dict[str, SLO] | SLO | None
    concurrency = wl.load.concurrency
    if is_run_dir(wl.load.trace):
        assert wl.load.trace is not None
        replay = requests_from_run(wl.load.trace, target, wl.load)
        reqs, slos, concurrency = replay.requests, replay.slos, replay.max_concurrency
        info: dict[str, Any] = {"load": wl.load.to_dict(), "seed": wl.seed, **replay.info}
    else:
        tokenizer, note = planning_tokenizer(target)
        reqs, info, slos = load_requests(
            wl.workload_or_default(),
            wl.load,
            wl.seed,
            target.engine_config.max_model_len or target.max_model_len,
            wl.endpoint,
            tokenizer=tokenizer,
            resend=target.resend,
            sim_seed=wl.sim_seed,
        )
        if note is not None and wl.load.trace is None:
            info.setdefault("notes", []).append(note)
    info["sim_seed"] = wl.sim_seed
    info["endpoint"] = wl.endpoint
    delay = spec.topology.network_delay
    if delay is None:  # a twin's clients sit half its measured API time away
        delay = float(target.info.get("api_overhead_s") or 0.0) / 2
    if wl.slo is not None:
        override = SLO.parse(wl.slo)
        slos = {k: v.merged(override) for k, v in slos.items()} if slos else override
    return Scenario(
        target=target,
        requests=reqs,
        topology=topology,
        network_delay=delay,
        max_concurrency=concurrency,
        slos=slos,
        info=info,
        sim_seed=wl.sim_seed,
    )


def point_changes(spec: TargetSpec, point: dict[str, Any]) -> dict[str, Any]:
    """A sweep point's engine-config changes as the target takes them: for the twin of
    vLLM, SGLang or llama-server, written in that server's flags and read back
    (``sim.fit.twin.engine_changes``: vLLM without chunking gets the context as its
    budget; ValueError for a setting the server has no flag for); else as given."""
    from servelab.analyze.server_side.serversettings import FLAGS
    from servelab.sim.fit.twin import TwinCalibration, engine_changes, is_twin_file

    if not point or spec.calibration is None or not is_twin_file(spec.calibration):
        return point
    twin = TwinCalibration.load(spec.calibration)
    return engine_changes(twin, point) if twin.server in FLAGS else point


def planning_tokenizer(target: SimTarget) -> tuple[Any, str | None]:
    """The tokenizer a twin's prompts are planned with: the one its calibration recorded
    for the served model, when it loads here (nothing is downloaded); else None (the
    planner's default) and one line saying that the prompts keep their planned token
    lengths but are not the served model's tokens. Not a twin: (None, None)."""
    from servelab.modelcore.tokenizer import Tokenizer
    from servelab.vocab import DEFAULT_MODEL

    name = target.info.get("tokenizer") if "twin_of" in target.info else None
    if not name:
        return None, None
    try:
        return Tokenizer.from_model(str(name)), None
    except (ValueError, OSError):
        return None, (
            f"note: no tokenizer {name!r} here: prompts planned by token length "
            f"({DEFAULT_MODEL}'s tokens)"
        )


def _simulate_point(
    scenario: Scenario,
    point: dict[str, Any],
    spec: SimSpec,
    in_sweep: bool,
    console: Console,
    keep: list[object] | None = None,
) -> dict[str, Any]:
    """Simulate ``scenario`` with the engine settings of one sweep point into the spec's run
    directory (in a sweep: one under it named for the point); return its row of the table.
    ``keep`` (``run_sim``'s) receives the simulated result."""
    from servelab.rundir import read_json
    from servelab.sim.fit.twin import outside_domain
    from servelab.sim.run_writer import write_run_dir
    from servelab.sim.scenario import simulate

    write_steps = spec.output.write_steps
    label, run_dir = _point_dir(scenario, point, spec.output.out, in_sweep)
    try:
        if point:
            changes = point_changes(spec.target, point)
            scenario = dataclasses.replace(
                scenario, target=scenario.target.with_engine_args(**changes)
            )
            scenario.target.engine_config.validate()
    except (TypeError, ValueError) as e:
        raise ValueError(f"sweep point {label}: {e}") from None
    if (run_dir / "requests.jsonl").exists():
        raise ValueError(
            f"{run_dir} already holds a run (requests.jsonl); choose another --out or delete it"
        )
    t0 = time.perf_counter()
    res = simulate(scenario, keep_steps=write_steps)
    wall = time.perf_counter() - t0
    if keep is not None:
        keep.append(res)
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
    say(console, f"wrote {run_dir}")
    beyond = outside_domain(scenario.target.info.get("domain"), res.records)
    if beyond is not None:
        say(console, beyond)
    return _summary_row(label, res, read_json(run_dir, "metrics.json") or {}, wall)


def _point_dir(
    scenario: Scenario, point: dict[str, Any], out: Path, in_sweep: bool
) -> tuple[str, Path]:
    """A sweep point's label and run directory (``out`` itself outside a sweep)."""
    label = ",".join(f"{k}={v}" for k, v in point.items()) or scenario.target.label
    return label, out / label.replace("=", "-").replace(",", "_") if in_sweep else out


def _intervals(
    spec: SimSpec,
    scenario: Scenario,
    point: dict[str, Any],
    seeds: range,
    in_sweep: bool,
    console: Console,
) -> None:
    """Repeat one simulated run (a sweep point) over more seeds; print and write each
    figure's range beside the run written for the first seed."""
    from servelab.report.twin_tables import prediction_table
    from servelab.sim.intervals import FIGURES, predict

    changes = point_changes(spec.target, point)

    def scenario_for(seed: int) -> Any:
        target = sim_target(spec.target, seed).with_engine_args(**changes)
        return dataclasses.replace(scenario, target=target, sim_seed=seed)

    label, run_dir = _point_dir(scenario, point, spec.output.out, in_sweep)
    stated = scenario.target.info.get("intervals") or {}
    levels = ("80", "95")
    widths = {lvl: float(stated[lvl]) for lvl in levels if lvl in stated}
    # a figure's own widths where the twin has them (a twin from before them has none)
    own = {
        name: {lvl: float(f[lvl]) for lvl in levels}
        for name, f in (stated.get("figures") or {}).items()
    }
    pred = predict(scenario_for, list(seeds), half_widths=widths, figure_widths=own)
    (run_dir / "prediction.json").write_text(json.dumps(pred.to_dict(), indent=1))
    title = f"{label}: median and range over {len(pred.seeds)} seeds"
    console.print(prediction_table(pred, title))
    if widths:
        lo, hi = math.exp(widths["80"]), math.exp(widths["95"])
        line = (
            f"80% and 95% intervals: a factor {lo:.2f} and {hi:.2f} either side of the median "
            "(leave-one-run-out)"
        )
        if own:  # the table gives each figure's factors and where they came from
            line = (
                f"80% and 95% intervals (leave-one-run-out): {len(own)} of {len(FIGURES)} "
                f"figures' own, else pooled x{lo:.2f} / x{hi:.2f}"
            )
        say(console, line)


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


def _capacity(spec: SimSpec, scenario: Scenario, console: Console) -> None:
    """Search the capacity ``spec`` asks for; print each point and the answer."""
    from servelab.sim.capacity import find_capacity

    search, wl = spec.search, spec.workload
    kind, target = search.find_capacity, search.attainment_target
    assert kind is not None
    result, what = find_capacity(
        kind,
        scenario,
        wl.workload_or_default(),
        wl.load,
        wl.seed,
        wl.endpoint,
        target,
        search.max_replicas,
        spec.topology.replicas,
    )
    for p in result.points:
        say(
            console,
            f"  {p.label:>16}: SLO attainment {p.attainment:.3f}, goodput {p.goodput:.3g} req/s"
            f"{'  meets' if p.meets else ''}",
        )
    answer = result.answer
    say(
        console,
        f"{what} meeting {target:.0%} SLO attainment: "
        f"{answer if answer is not None else 'none within the searched range'}",
    )
    run_dir = spec.output.out
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "capacity.json").write_text(
        json.dumps({"search": kind, **result.to_dict()}, indent=1)
    )
    say(console, f"wrote {run_dir / 'capacity.json'}")
