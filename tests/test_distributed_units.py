"""Distributed bench, the parts without processes: partition, clocks, feed, concurrency."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from servelab.bench.client.http import HttpClient
from servelab.bench.client.monitor import ClientHealth
from servelab.bench.client.send import Target
from servelab.bench.distributed.bench_worker import BenchWorkerCore, SessionFeed
from servelab.bench.distributed.clock import boot_id, measure_offset, timing_error_budget
from servelab.bench.distributed.driver import WorkerPool
from servelab.bench.distributed.messages import (
    DONE,
    FAILED,
    RECORDS,
    SENT,
    StageDone,
    StageJob,
    WorkerInfo,
)
from servelab.bench.distributed.partition import (
    concurrency_over_time,
    partition,
    split_concurrency,
)
from servelab.bench.plan_runner import START_DELAY_S, PlanRunner, request_id, sessions
from servelab.bench.workloads.request_plan import LoadSpec, build_plan
from servelab.bench.workloads.spec import WorkloadSpec
from servelab.testing.testserver import Schedule, TestServer
from servelab.testing.tokenizers import one_request, tiny_tokenizer
from servelab.vocab import ClientRecord

SPEC = {
    "name": "mix",
    "classes": [
        {"name": "single", "weight": 1, "input": 12, "output": 4},
        {
            "name": "conv",
            "weight": 1,
            "input": 10,
            "output": 3,
            "session": {"turns": {"dist": "uniform", "min": 1, "max": 4}, "think_time": 0},
        },
    ],
}


@pytest.fixture(scope="module")
def plan():
    return build_plan(
        WorkloadSpec.model_validate(SPEC),
        LoadSpec(rate=10, requests=60),
        7,
        tokenizer=tiny_tokenizer(),
    )


def test_split_concurrency_is_even_and_never_empty():
    assert split_concurrency(10, 4) == [3, 3, 2, 2]
    assert split_concurrency(3, 8) == [1, 1, 1]  # fewer streams than workers: fewer workers
    assert split_concurrency(2000, 4) == [500] * 4
    with pytest.raises(ValueError):
        split_concurrency(0, 2)


@pytest.mark.parametrize("weights", [[1, 1, 1], [3, 1], [1]])
def test_partition_deals_whole_sessions_and_its_union_is_the_plan(plan, weights):
    shares = partition(plan, weights)
    ids = [r.request_id for share in shares for r in share]
    assert sorted(ids) == sorted(r.request_id for r in plan)  # disjoint, nothing lost
    assert len(set(ids)) == len(ids)
    owner = {}
    for i, share in enumerate(shares):
        assert [r.index for r in share] == sorted(r.index for r in share)  # plan order kept
        for r in share:
            if r.tags.session_id is not None:
                assert owner.setdefault(r.tags.session_id, i) == i  # a session on one worker
    n_sessions = [len(list(sessions(share))) for share in shares]
    total = sum(n_sessions)
    for n, w in zip(n_sessions, weights, strict=True):
        assert abs(n - total * w / sum(weights)) <= 1  # shares follow the weights
    with pytest.raises(ValueError, match="weight"):
        partition(plan, [1, 0])


def _rec(rid: str, send: float, done: float | None, error: str | None = None) -> ClientRecord:
    return ClientRecord(
        request_id=rid,
        workload_class="c",
        intended_send=send,
        actual_send=send,
        done=done,
        error=error,
    )


def test_concurrency_over_time_is_time_weighted():
    recs = [
        _rec("a", 0.0, 2.0),
        _rec("b", 1.0, 2.0),
        _rec("c", 2.0, 3.0),  # starts as a and b end: back to back, not a third in flight
        _rec("s", 0.5, None, error="skipped: never sent"),
    ]
    c = concurrency_over_time(recs, 0.0, 4.0)
    assert c["max"] == 2
    assert c["mean"] == pytest.approx((2.0 + 1.0 + 1.0) / 4.0)
    assert [v for t, v in c["series"] if t == pytest.approx(1.5)] == [pytest.approx(2.0)]
    assert concurrency_over_time([], 0.0, 1.0)["max"] == 0


def _fake_ping(offset: float, delays: list[tuple[float, float]], boot: str):
    """A worker whose clock is the driver's + offset, answering after out/back delays."""
    it = iter(delays)

    async def ping():
        out, back = next(it)
        await asyncio.sleep(out)
        t = time.monotonic() + offset
        await asyncio.sleep(back)
        return t, boot

    return ping


def test_clock_offset_is_found_within_half_the_best_round_trip():
    delays = [(0.03, 0.001), (0.002, 0.002), (0.001, 0.02), (0.004, 0.004)]
    c = asyncio.run(measure_offset(_fake_ping(12.5, delays, "b"), 4, local_boot="a"))
    assert c.rtt_min_s < 0.01  # the symmetric fast sample was chosen
    assert abs(c.offset_s - 12.5) <= c.uncertainty_s
    assert not c.same_host and c.applied_offset_s == c.offset_s
    assert c.applied_uncertainty_s == c.uncertainty_s
    assert c.to_driver(c.to_worker(100.0)) == pytest.approx(100.0)


def test_same_host_clock_is_shared_only_when_the_measurement_agrees():
    same = asyncio.run(measure_offset(_fake_ping(0.0, [(0.001, 0.001)] * 3, "a"), 3, "a"))
    assert same.same_host and same.applied_offset_s == 0.0 and same.applied_uncertainty_s == 0.0
    # same boot id but a clearly shifted clock (a time namespace): apply what was measured
    shifted = asyncio.run(measure_offset(_fake_ping(5.0, [(0.001, 0.001)] * 3, "a"), 3, "a"))
    assert shifted.same_host and shifted.applied_offset_s == pytest.approx(5.0, abs=0.01)


def test_timing_error_budget_adds_the_clock_terms_across_workers():
    c = asyncio.run(measure_offset(_fake_ping(3.0, [(0.002, 0.002)] * 2, "x"), 2, "y"))
    c.drift_s = -0.0004
    b = timing_error_budget(0.002, [c])
    assert b["within_one_worker_s"] == 0.002
    assert b["across_workers_s"] == pytest.approx(0.002 + c.uncertainty_s + 0.0004)
    assert timing_error_budget(None)["across_workers_s"] == 0.0


def test_session_feed_serves_waiting_streams_then_ends():
    async def go():
        feed = SessionFeed()
        got: list[str] = []

        async def stream():
            async for turns in feed:
                got.append(turns[0].request_id)

        tasks = [asyncio.ensure_future(stream()) for _ in range(3)]
        await asyncio.sleep(0.02)  # every stream waits on the empty feed
        feed.put([[one_request(f"r{i}", "p", 1, index=i)] for i in range(5)])
        await asyncio.sleep(0)
        feed.close()
        await asyncio.wait_for(asyncio.gather(*tasks), 2)
        return got, feed.wait_s

    got, waited = asyncio.run(go())
    assert sorted(got) == [f"r{i}" for i in range(5)]  # each session to exactly one stream
    assert waited > 0


def test_a_closed_loop_runs_from_a_feed_and_starts_at_the_given_time():
    server = TestServer(Schedule(ttft=0.01, itl=0.002))

    async def go(url):
        feed = SessionFeed()
        feed.put([[one_request(f"r{i:06d}", "hi", 3, index=i)] for i in range(4)])
        http = HttpClient(url)
        runner = PlanRunner(http, Target(url, "test-model"), LoadSpec(concurrency=2), run_tag="t")
        at = time.monotonic() + 0.2
        task = asyncio.ensure_future(runner.run(feed, start_at=at))
        await asyncio.sleep(0.4)
        feed.put([[one_request("r000004", "hi", 3, index=4)]])
        feed.close()
        res = await asyncio.wait_for(task, 10)
        await http.close()
        return res, at

    with server.running() as url:
        res, at = asyncio.run(go(url))
    assert res.start == at
    assert min(r.actual_send for r in res.records) >= at
    assert sorted(r.request_id for r in res.records) == [f"t-r{i:06d}" for i in range(5)]
    assert all(r.ok for r in res.records)
    fed = next(r for r in res.records if r.request_id == "t-r000004")
    assert fed.sent_request_id in server.served  # the session fed while the loop ran was sent too


class FakeWorker:
    """A worker that records the first ``ok`` requests of its share, has the next one in
    flight, then reports its stage failed (or, with ``ok=None``, finishes them all)."""

    kind = "fake"

    def __init__(self, index: int, ok: int | None = None) -> None:
        self.info = WorkerInfo(index=index, pid=100 + index, host="here", boot_id=boot_id())
        self.ok = ok
        self.lost = None
        self.job: StageJob | None = None
        self.at = 0.0

    @property
    def alive(self) -> bool:
        return self.lost is None

    def describe(self) -> str:
        return f"worker {self.info.index}"

    async def ping(self):
        return time.monotonic(), boot_id()

    async def setup(self, job: StageJob) -> None:
        self.job = job

    async def feed(self, sessions, end=False) -> None:
        raise AssertionError("not fed")

    async def start(self, at: float) -> None:
        self.at = at

    async def stop(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def events(self):
        assert self.job is not None
        share, tag = self.job.share, self.job.run_tag
        n = len(share) if self.ok is None else self.ok
        sent = [(request_id(tag, r), self.at + 0.01 * i) for i, r in enumerate(share[: n + 1])]
        recs = [
            ClientRecord(
                request_id=request_id(tag, r),
                workload_class=r.tags.workload_class,
                intended_send=t,
                actual_send=t,
                done=t + 0.5,
            )
            for r, (_, t) in zip(share[:n], sent, strict=False)
        ]
        yield [(SENT, sent), (RECORDS, recs)]
        if self.ok is None:
            done = StageDone(
                start=self.at,
                end=self.at + 1,
                sent=n,
                interrupted=False,
                health=ClientHealth(),
                stamping="x",
                late_start_s=0,
                feed_wait_s=0,
            )
            yield [(DONE, done)]
        else:
            yield [(FAILED, "Traceback (most recent call last):\n  ...\nValueError: boom\n")]


def test_a_failed_worker_has_its_unrecorded_share_recorded_as_lost(plan):
    pool = WorkerPool([FakeWorker(0), FakeWorker(1, ok=2)], Target("http://x", "m"), "fake")
    load = LoadSpec(rate=10, requests=60)
    written: list[ClientRecord] = []
    stage = asyncio.run(pool.run_stage(list(plan), load, run_tag="t", on_record=written.append))
    assert sorted(r.request_id for r in written) == sorted(f"t-{p.request_id}" for p in plan)
    assert written == stage.result.records
    lost = [r for r in written if not r.ok]
    assert all(r.error.startswith("worker_lost: worker 1 failed: ValueError: boom") for r in lost)
    assert sum(r.error.endswith("while it was in flight") for r in lost) == 1
    assert len(lost) == stage.report["workers"][1]["assigned"] - 2
    assert stage.report["lost"]["share"] == pytest.approx(len(lost) / len(plan))
    assert "ValueError: boom" in stage.report["lost"]["errors"][0]
    assert not stage.report["complete"] and pool.lost == ["worker 1 failed: ValueError: boom"]
    assert not stage.health.valid and "incomplete" in stage.health.reasons[-1]
    # lost first turns keep their planned send time on the driver's clock
    start = stage.result.start
    by_id = {f"t-{p.request_id}": p for p in plan}
    for r in lost:
        p = by_id[r.request_id]
        if p.tags.turn == 0 and not r.error.endswith("in flight"):
            assert r.intended_send - start == pytest.approx(START_DELAY_S + p.send_time)


def test_a_lost_request_keeps_every_tag_it_was_planned_with(plan):
    tagged = [
        replace(
            p,
            tags=replace(p.tags, prefix_group=f"g{p.index % 3}", stream=p.index % 2 == 0),
        )
        for p in plan
    ]
    pool = WorkerPool([FakeWorker(0), FakeWorker(1, ok=2)], Target("http://x", "m"), "fake")
    stage = asyncio.run(pool.run_stage(tagged, LoadSpec(rate=10, requests=60), run_tag="t"))
    by_id = {f"t-{p.request_id}": p for p in tagged}
    lost = [r for r in stage.result.records if not r.ok]
    assert lost
    for r in lost:
        tags = by_id[r.request_id].tags
        assert (r.workload_class, r.session_id, r.turn, r.prefix_group, r.stream) == (
            tags.workload_class,
            tags.session_id,
            tags.turn,
            tags.prefix_group,
            tags.stream,
        )


def test_a_worker_whose_stage_raises_reports_it_as_its_last_event():
    async def go():
        core = BenchWorkerCore(3, Target("http://127.0.0.1:9", "m"))
        core.setup(StageJob(load=LoadSpec(rate=1, requests=1), run_tag="t", stage=None, fed=True))
        core.start(time.monotonic())
        batches = []
        while (batch := await asyncio.wait_for(core.next_batch(), 5)) is not None:
            batches.append(batch)
        await core.close()
        return batches

    batches = asyncio.run(go())
    assert [kind for b in batches for kind, _ in b] == [FAILED]
    assert "TypeError: an open loop needs its whole plan" in batches[0][0][1]
