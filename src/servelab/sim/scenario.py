"""A simulated scenario: the requests (from a workload or a trace), the deployment, the
network, and the SLOs; :func:`simulate` runs it.

Workloads and loads use the benchmark's own types (``bench.workloads.spec``, ``bench.plan.LoadSpec``),
so ``servelab sim`` takes the same workload names, files and load flags as ``servelab bench``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from servelab.sim.loop.history import Resend
from servelab.sim.loop.simulation import SimRequest, SimResult, Simulation, Topology
from servelab.sim.sim_target import SimTarget
from servelab.units import SLO
from servelab.vocab import DEFAULT_MODEL


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
