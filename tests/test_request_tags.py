"""A request's tags travel from its plan to its ClientRecord unchanged, on every path that
builds a record: the bench client (sent or skipped), the distributed workers and driver, and
the simulator (sent or skipped)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import aiohttp

from servelab.bench.client.http import HttpClient
from servelab.bench.client.send import Target
from servelab.bench.distributed.driver import WorkerPool
from servelab.bench.plan_runner import PlanRunner
from servelab.bench.workloads.request_plan import LoadSpec, PlannedRequest, build_plan
from servelab.bench.workloads.spec import WorkloadSpec
from servelab.engine.engine_config import EngineConfig
from servelab.rundir import RunDir
from servelab.sim.loop.sim_requests import requests_from_plan
from servelab.sim.loop.simulation import SimRequest, Simulation
from servelab.sim.sim_target import roofline_target
from servelab.testing.testserver import Schedule, run_test_server
from servelab.testing.tokenizers import tiny_tokenizer
from servelab.vocab import ClientRecord, RequestTags

# Every tag but ``priority`` and ``temperature``, which go in the request body and are not
# recorded.
SENT_ONLY = ("priority", "temperature")
RECORDED = tuple(f.name for f in dataclasses.fields(RequestTags) if f.name not in SENT_ONLY)

# Every tag set away from its default, so a tag the record drops cannot pass unnoticed.
SPEC = {
    "name": "tagged",
    "classes": [
        {
            "name": "agent",
            "input": 12,
            "output": 3,
            "prefix": [{"name": "tools", "count": 2, "tokens": 8, "reuse": 1.0}],
            "session": {"turns": 2, "think_time": 0},
            "stream": False,
            "priority": 2,
            "temperature": 0.0,
        },
        {"name": "chat", "input": 10, "output": 3, "priority": 1},
    ],
}


def _plan(n_sessions: int) -> list[PlannedRequest]:
    spec = WorkloadSpec.model_validate(SPEC)
    load = LoadSpec(rate=50, requests=n_sessions)
    return build_plan(spec, load, 3, tokenizer=tiny_tokenizer())


def _recorded(rec: ClientRecord) -> dict:
    return {name: getattr(rec, name) for name in RECORDED}


def _planned(tags: RequestTags) -> dict:
    return {name: getattr(tags, name) for name in RECORDED}


def test_the_plan_sets_every_tag_away_from_its_default():
    plan = _plan(6)
    for name in (*RECORDED, *SENT_ONLY):
        default = getattr(RequestTags(), name)
        assert any(getattr(p.tags, name) != default for p in plan), name


def test_the_one_constructor_records_every_tag_and_the_send(tmp_path):
    tags = RequestTags(
        workload_class="agent",
        session_id="s7",
        turn=1,
        prefix_group="agent:tools1",
        stream=False,
        priority=2,
    )
    rec = ClientRecord.for_request(
        "t-r000001",
        tags,
        stage="rate=2",
        intended_send=10.0,
        actual_send=10.5,
        input_tokens=200,
        requested_output_tokens=3,
        error="skipped: turn t-r000000 of this session failed, so it was not sent",
    )
    assert set(RECORDED) <= {f.name for f in dataclasses.fields(ClientRecord)}
    assert _recorded(rec) == _planned(tags)
    assert (rec.request_id, rec.stage, rec.intended_send, rec.actual_send) == (
        "t-r000001",
        "rate=2",
        10.0,
        10.5,
    )
    assert (rec.input_tokens, rec.requested_output_tokens) == (200, 3)
    assert rec.error.startswith("skipped")
    # requests.jsonl keeps its fields, in their order
    rd = RunDir(tmp_path)
    rd.add_record(rec)
    rd.close()
    line = json.loads((tmp_path / "requests.jsonl").read_text())
    assert list(line) == [
        "request_id",
        "workload_class",
        "intended_send",
        "actual_send",
        "input_tokens",
        "output_tokens",
        "token_source",
        "client_output_tokens",
        "disputed_usage",
        "requested_output_tokens",
        "stream",
        "first_byte",
        "chunk_times",
        "chunk_tokens",
        "done",
        "status",
        "error",
        "session_id",
        "turn",
        "prefix_group",
        "stage",
        "server_timeline",
        "reasoning_tokens",
        "first_output",
        "cached_tokens",
        "sent_request_id",
        "server_request_id",
        "response_id",
        "new_connection",
        "dns_time",
        "connect_time",
        "tls_time",
        "connected",
        "request_written",
    ]
    assert {k: line[k] for k in RECORDED} == _planned(tags)


def _served_bodies(url: str) -> dict[str, dict]:
    async def get():
        async with aiohttp.ClientSession() as s, s.get(f"{url}/test/requests") as r:
            return {x["id"]: x["body"] for x in await r.json()}

    return asyncio.run(get())


def _run(url: str, plan: list[PlannedRequest], stage: str) -> list[ClientRecord]:
    async def go():
        http = HttpClient(url)
        runner = PlanRunner(
            http, Target(url, "test-model"), LoadSpec(rate=50), run_tag="t", stage=stage
        )
        res = await runner.run(plan)
        await http.close()
        return res.records

    return asyncio.run(go())


def test_the_bench_client_records_the_tags_and_sends_the_priority():
    plan = _plan(6)
    with run_test_server(Schedule(ttft=0.005, itl=0.001)) as url:
        recs = {r.request_id: r for r in _run(url, plan, "rate=50")}
        bodies = _served_bodies(url)
    assert len(recs) == len(plan) and all(r.ok for r in recs.values())
    for p in plan:
        rec = recs[f"t-{p.request_id}"]
        assert _recorded(rec) == _planned(p.tags) and rec.stage == "rate=50"
        body = bodies[rec.sent_request_id]
        assert body["stream"] == p.tags.stream and body.get("priority", 0) == p.tags.priority
        assert body.get("temperature") == p.tags.temperature


def test_a_skipped_turn_keeps_the_tags_it_was_planned_with():
    plan = _plan(6)
    with run_test_server(Schedule(status=503)) as url:
        recs = {r.request_id: r for r in _run(url, plan, "s")}
    skipped = [p for p in plan if recs[f"t-{p.request_id}"].error.startswith("skipped")]
    assert skipped and all(p.tags.turn > 0 for p in skipped)
    for p in plan:
        assert _recorded(recs[f"t-{p.request_id}"]) == _planned(p.tags)


def test_worker_processes_and_the_driver_keep_every_tag():
    plan = _plan(8)

    async def go(url):
        pool = await WorkerPool.start(2, Target(url, "test-model"))
        try:
            stage = await pool.run_stage(plan, LoadSpec(rate=50, requests=8), run_tag="t")
        finally:
            await pool.close()
        return stage.result.records

    with run_test_server(Schedule(ttft=0.005, itl=0.001)) as url:
        recs = {r.request_id: r for r in asyncio.run(go(url))}
    assert len(recs) == len(plan)
    for p in plan:
        assert _recorded(recs[f"t-{p.request_id}"]) == _planned(p.tags)


def test_the_simulator_records_the_tags_of_the_plan():
    plan = _plan(6)
    reqs = requests_from_plan(plan, tiny_tokenizer())
    assert all(r.tags is p.tags for r, p in zip(reqs, plan, strict=True))
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=1024)
    target = roofline_target("h100", "llama-3.1-8b", engine_config=config)
    res = Simulation(target.factory, reqs).run()
    recs = {r.request_id: r for r in res.records}
    assert len(recs) == len(plan) and all(r.ok for r in recs.values())
    for p in plan:
        assert _recorded(recs[p.request_id]) == _planned(p.tags)


def test_a_turn_the_simulator_skips_keeps_its_tags():
    tags = [
        RequestTags(workload_class="agent", session_id="a", turn=t, stream=False, priority=2)
        for t in range(2)
    ]
    reqs = [
        SimRequest("a0", 0.0, [5] * 2000, 10, tags=tags[0]),
        SimRequest("a1", 0.0, [5] * 10, 10, tags=tags[1], after="a0"),
    ]
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024)
    target = roofline_target("h100", "llama-3.1-8b", engine_config=config)
    a0, a1 = Simulation(target.factory, reqs).run().records
    assert a0.status == 400 and a1.error.startswith("skipped")
    assert [_recorded(a0), _recorded(a1)] == [_planned(t) for t in tags]
