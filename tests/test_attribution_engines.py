"""TTFT attribution over deployments of several engines: replicas and disaggregated workers.

Each replica (and each prefill or decode worker) runs its own steps at the same times as the
others; a request's parts must come from its own engine's steps, or they stop adding up.
"""

from __future__ import annotations

import pytest
import rundirs

from servelab.analyze.diagnosis.attribution import attribute
from servelab.bench.workloads.request_plan import LoadSpec
from servelab.rundir import load_run
from servelab.sim.loop.links import parse_link
from servelab.sim.loop.simulation import Topology
from servelab.sim.run_writer import write_run_dir
from servelab.sim.scenario import Scenario, load_requests, simulate
from servelab.sim.sim_target import roofline_target


def assert_parts_add_up(run) -> None:
    exact = [b for b in attribute(run).ttft if b.source == "exact"]
    assert len(exact) == len([r for r in run.records if r.ok and r.chunk_times])
    for b in exact:
        assert sum(b.parts().values()) == pytest.approx(b.ttft + b.client_lag, abs=1e-6)
        assert b.prefill <= b.ttft + 1e-9 and b.interference <= b.ttft + 1e-9


def simulated_run(tmp_path, topology: Topology, requests: int = 400):
    target = roofline_target("h100", "llama-3.1-8b")
    reqs, info, slos = load_requests(
        None, LoadSpec(trace="azure-2023-conv", requests=requests), 0, 8192
    )
    res = simulate(Scenario(target, reqs, topology, slos=slos))
    return load_run(write_run_dir(tmp_path / "run", res, target=target.describe(), n_boot=0))


def test_ttft_parts_add_up_for_every_request_of_four_replicas(tmp_path):
    run = simulated_run(tmp_path, Topology(replicas=4, router="round-robin"))
    assert {(s.role, s.replica) for s in run.steps} == {("colocated", i) for i in range(4)}
    assert {t.replica for t in run.timelines.values()} == {0, 1, 2, 3}
    assert_parts_add_up(run)


def test_ttft_parts_add_up_for_disaggregated_prefill_and_decode(tmp_path):
    topo = Topology(prefill=2, decode=2, link=parse_link("nvlink"))
    run = simulated_run(tmp_path, topo, requests=200)
    assert {(s.role, s.replica) for s in run.steps} == {
        ("prefill", 0),
        ("prefill", 1),
        ("decode", 0),
        ("decode", 1),
    }
    handed_off = [t for t in run.timelines.values() if t.decode_replica is not None]
    assert handed_off and all(t.role == "prefill" for t in handed_off)
    assert_parts_add_up(run)


def test_another_servers_queueing_under_kv_pressure_is_put_down_to_kv(tmp_path):
    # vLLM's figures place each wait; the /metrics series says the server preempted during it.
    pre = attribute(
        load_run(rundirs.as_other_target(rundirs.preemptions(tmp_path / "p"), figures=True))
    )
    queued = [b for b in pre.ttft if b.queue]
    assert queued and {b.queue_reason for b in queued} == {"kv"}
    calm = attribute(load_run(rundirs.as_other_target(rundirs.burst(tmp_path / "b"), figures=True)))
    assert {b.queue_reason for b in calm.ttft if b.queue} == {"other"}
