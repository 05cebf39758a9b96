"""A simulated scenario: the requests (from a workload or a trace), the deployment, the
network, and the SLOs; :func:`simulate` runs it.

Workloads and loads use the benchmark's own types (``bench.workloads.spec``, ``bench.plan.LoadSpec``),
so ``servelab sim`` takes the same workload names, files and load flags as ``servelab bench``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from servelab.sim.loop.history import Resend
from servelab.sim.loop.simulation import SimRequest, SimResult, Simulation, Topology
from servelab.sim.sim_target import SimTarget
from servelab.units import SLO
from servelab.vocab import DEFAULT_MODEL, RequestTags


@dataclass
class Scenario:
    """``sim_seed`` seeds the simulator's own draws (step noise, speculative acceptance);
    the requests, resent-history draws included, come from ``load_requests``."""

    target: SimTarget
    requests: list[SimRequest]
    topology: Topology = field(default_factory=Topology)
    network_delay: float = 0.0
    max_concurrency: int | None = None
    slos: dict[str, SLO] | SLO | None = None
    info: dict[str, Any] = field(default_factory=dict)  # workload, load, trace report
    sim_seed: int = 0

    def with_topology(self, topology: Topology) -> Scenario:
        return replace(self, topology=topology)


def simulate(
    scenario: Scenario,
    keep_steps: bool = True,
    step_sink: Callable[[dict[str, Any]], None] | None = None,
    decode_bursts: bool = True,
) -> SimResult:
    """Run the scenario once, deterministically (``decode_bursts``: see ``Simulation``)."""
    t = scenario.target
    return Simulation(
        t.factory,
        scenario.requests,
        scenario.topology,
        network_delay=scenario.network_delay,
        max_concurrency=scenario.max_concurrency,
        kv_bytes_per_token=t.kv_bytes_per_token,
        keep_steps=keep_steps,
        step_sink=step_sink,
        block_size=t.engine_config.block_size,
        sim_seed=scenario.sim_seed,
        decode_bursts=decode_bursts,
    ).run()


def load_requests(
    workload: str | None,
    load: Any,
    seed: int,
    max_model_len: int,
    endpoint: str = "completions",
    tokenizer: Any = None,
    resend: Resend | None = None,
    sim_seed: int = 0,
) -> tuple[list[SimRequest], dict[str, Any], dict[str, SLO] | None]:
    """Requests of a workload (through ``bench.plan.build_plan``) or of ``load.trace``.

    Returns the requests, what to record about them in the manifest, and the workload's
    SLOs per class (None for a trace). ``tokenizer`` defaults to the default model's;
    ``resend`` is the target's (``SimTarget``), for multi-turn sessions, drawn
    per ``seed`` and ``sim_seed``.
    """
    from servelab.sim.loop.sim_requests import requests_from_plan, requests_from_trace

    load.validate()
    info: dict[str, Any] = {"load": load.to_dict(), "seed": seed}
    if load.trace is not None and Path(load.trace).is_dir():
        raise ValueError(
            f"--trace {load.trace} is a run directory, replayed at its own load: "
            "a search over loads (--find-capacity rate) needs a workload or a trace file"
        )
    if load.trace is not None:
        reqs, trace_info = requests_from_trace(
            load.trace,
            time_scale=load.time_scale,
            length_scale=load.length_scale,
            max_model_len=max_model_len,
            max_requests=load.requests,
            max_duration=load.duration,
            target_rate=None if load.closed else load.rate,
        )
        if load.closed:
            reqs = [replace(r, send_time=0.0) for r in reqs]
        info.update(trace_info)
        return reqs, info, None
    if workload is None:
        raise ValueError("give a workload (--workload NAME|FILE) or a trace (--trace FILE)")
    from servelab.bench.workloads.request_plan import build_plan
    from servelab.bench.workloads.spec import load_workload

    spec = load_workload(workload)
    if tokenizer is None:
        from servelab.modelcore.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_model(DEFAULT_MODEL)
    plan = build_plan(
        spec, load, seed, tokenizer=tokenizer, endpoint=endpoint, max_model_len=max_model_len
    )
    info["workload"] = spec.model_dump(mode="json")
    info["plan"] = plan.info
    reqs = requests_from_plan(
        plan,
        tokenizer,
        endpoint,
        resend=resend,
        draw_key=f"{seed}:{sim_seed}",
    )
    return reqs, info, spec.class_slos()


def slo_of(slos: dict[str, SLO] | SLO | None, workload_class: str) -> SLO:
    if isinstance(slos, dict):
        return slos.get(workload_class, SLO())
    return slos or SLO()


def attainment(result: SimResult, slos: dict[str, SLO] | SLO | None) -> float:
    """Fraction of requests that succeeded and met every SLO of their class."""
    recs = result.records
    if not recs:
        return 0.0
    return sum(1 for r in recs if r.ok and slo_of(slos, r.workload_class).met(r)) / len(recs)


@dataclass
class RunRequests:
    """A run directory's requests as the simulated client sends them (``requests_from_run``):
    ``max_concurrency`` a closed loop's, ``slos`` the classes' the run was judged by."""

    requests: list[SimRequest]
    info: dict[str, Any]
    slos: dict[str, SLO] | None
    max_concurrency: int | None = None


def is_run_dir(path: str | None) -> bool:
    """Whether a ``--trace`` names a run directory rather than a trace file."""
    return path is not None and (Path(path) / "manifest.json").is_file()


def requests_from_run(
    path: str, target: SimTarget, load: Any, tokenizer: Any = None
) -> RunRequests:
    """The requests a run directory (servelab's own, simulated or another server's) sent,
    with its send times, prompt and output lengths and shared prefixes.

    A run whose manifest rebuilds its plan is replayed as :func:`sim.fit.asrun.requests_as_run`
    rebuilds it (the same prompts, sessions and shared prefixes, the measured sends and think
    times, a closed loop kept closed). Any other (imported, or planned with a tokenizer not
    on this machine) replays its records: each sent at its measured send (a closed loop's
    kept closed at its concurrency), of its recorded
    prompt and output lengths, its first tokens its prefix group's (or session's), as many
    as the most the server reported serving from its prefix cache to one of the group
    (none where it reported nothing); whether they hit is the simulated cache's to say. ``tokenizer``: the one to plan with
    (None: the run's own). The load flags that would reshape it are refused."""
    from servelab.rundir import load_run
    from servelab.sim.fit.asrun import NotReplayable, Replica, recorded_slos, requests_as_run

    reshaped = {
        "--rate": load.rate is not None,
        "--concurrency": load.concurrency is not None,
        "--time-scale": load.time_scale != 1.0,
        "--length-scale": load.length_scale != 1.0,
        "--duration": load.duration is not None,
    }
    given = [name for name, on in reshaped.items() if on]
    if given:
        raise ValueError(f"--trace {path} replays a run as it ran: drop {', '.join(given)}")
    run = load_run(path)
    try:
        as_run = requests_as_run(run, tokenizer, Replica(target))
        reqs, how = as_run.requests, "as planned (the manifest's workload, load and seed)"
        slos, concurrency = as_run.slos or None, as_run.max_concurrency
        notes = []
    except (NotReplayable, ValueError) as e:
        reqs, how = _recorded_requests(run), f"from its records ({str(e).rstrip('.')})"
        slos, concurrency = recorded_slos(run) or None, _closed_loop(run)
        notes = [
            f"note: {run.name} replays from its records: sends, lengths, and shared "
            "prefixes as far as the server reported cache hits"
        ]
    if not reqs:
        raise ValueError(f"--trace {path}: the run has no completed request to replay")
    if load.requests is not None:
        reqs = reqs[: load.requests]
    info = {"trace": {"run": str(path), "replayed": how, "requests": len(reqs)}, "notes": notes}
    return RunRequests(reqs, info, slos, concurrency)


def _closed_loop(run: Any) -> int | None:
    """The concurrency a run's client held (``--concurrency`` without a rate), so that a
    replay from records keeps the loop closed: a request sent at its measured send or, when
    a twin runs slower than the server did, once a slot frees, as the client would have."""
    load = run.load
    concurrency = load.get("concurrency")
    return int(concurrency) if concurrency and load.get("rate") is None else None


def _recorded_requests(run: Any) -> list[SimRequest]:
    """One request per completed record, sent when it was sent (``requests_from_run``)."""
    from servelab.analyze.server_side.stepinfer import cached_size, estimated_cached
    from servelab.sim.loop.sim_requests import synthetic_ids

    recs = sorted(
        (r for r in run.records if r.ok and r.input_tokens > 0), key=lambda r: r.actual_send
    )
    if not recs:
        return []
    est = estimated_cached(run.records, run.scrapes)
    hits = {r.request_id: cached_size(r, est) for r in recs}
    group_of = {r.request_id: r.prefix_group or r.session_id for r in recs}
    widest: dict[str, int] = {}
    for r in recs:
        g, hit = group_of[r.request_id], hits[r.request_id]
        if g is not None and hit is not None:
            widest[g] = max(widest.get(g, 0), hit)
    keys = {g: 10**9 + k for k, g in enumerate(dict.fromkeys(filter(None, group_of.values())))}
    t0 = recs[0].actual_send
    out = []
    for i, r in enumerate(recs):
        g = group_of[r.request_id]
        shared = 0 if g is None else min(r.input_tokens, widest.get(g, 0))
        ids = synthetic_ids(keys[g], shared) if g is not None and shared else []
        ids += synthetic_ids(i, r.input_tokens - len(ids))
        out.append(
            SimRequest(
                request_id=r.request_id,
                send_time=r.actual_send - t0,
                prompt_token_ids=ids,
                max_tokens=max(1, r.output_tokens),
                tags=RequestTags(
                    workload_class=r.workload_class,
                    session_id=r.session_id,
                    turn=r.turn,
                    prefix_group=r.prefix_group,
                    stream=r.stream,
                ),
            )
        )
    return out
