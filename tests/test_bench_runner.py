"""The runner: closed-loop concurrency and duration, open-loop schedule, failed sessions."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest

from servelab.bench.client.http import HttpClient
from servelab.bench.client.send import Target
from servelab.bench.plan_runner import PlanRunner, busiest_window, sessions
from servelab.bench.workloads.request_plan import LoadSpec, PlannedRequest
from servelab.testing.testserver import Schedule, run_test_server
from servelab.vocab import RequestTags


@pytest.fixture(scope="module")
def url():
    with run_test_server(Schedule(ttft=0.03, itl=0.01)) as u:
        yield u


def _req(
    i: int, send: float | None = None, session: str | None = None, turn: int = 0, tokens: int = 5
) -> PlannedRequest:
    return PlannedRequest(
        request_id=f"r{i:06d}",
        index=i,
        tags=RequestTags(workload_class="c", session_id=session, turn=turn),
        prompt=f"prompt {i}",
        prompt_tokens=3,
        max_tokens=tokens,
        send_time=send,
        think_time=0.05 if turn else 0.0,
    )


def _execute(url: str, load: LoadSpec, plan, schedule: dict | None = None, cold: bool = False):
    async def go():
        http = HttpClient(url)
        headers = {"X-Test-Schedule": json.dumps(schedule)} if schedule else {}
        target = Target(url, "test-model", extra_headers=headers, cold_connections=cold)
        res = await PlanRunner(http, target, load, run_tag="t").run(plan)
        await http.close()
        return res

    return asyncio.run(go())


def test_closed_loop_keeps_concurrency_and_stops_at_duration(url):
    plan = (_req(i) for i in itertools.count())  # endless, as iter_plan is for --duration
    res = _execute(url, LoadSpec(concurrency=3, duration=1.0), plan)
    recs = sorted(res.records, key=lambda r: r.actual_send)
    assert len(recs) >= 6 and all(r.ok for r in recs)
    assert max(r.actual_send for r in recs) <= res.start + 1.0
    # never more than 3 in flight: count overlaps at every send
    for r in recs:
        in_flight = sum(o.actual_send <= r.actual_send < o.done for o in recs)
        assert in_flight <= 3
    assert max(sum(o.actual_send <= r.actual_send < o.done for o in recs) for r in recs) == 3


def test_open_loop_sends_on_schedule_even_when_the_server_is_slow(url):
    # each request takes ~0.5 s; sends every 0.05 s must not wait for completions
    plan = [_req(i, send=i * 0.05, tokens=40) for i in range(8)]
    res = _execute(url, LoadSpec(rate=20, requests=8), plan)
    recs = sorted(res.records, key=lambda r: r.intended_send)
    gaps = [b.intended_send - a.intended_send for a, b in itertools.pairwise(recs)]
    assert gaps == pytest.approx([0.05] * 7, abs=1e-9)
    assert recs[-1].actual_send < recs[0].done  # the last went out before the first finished


def test_a_failed_turn_skips_the_rest_of_its_session(url):
    plan = [_req(0, 0.0, "s0", 0), _req(1, None, "s0", 1), _req(2, None, "s0", 2)]
    res = _execute(url, LoadSpec(rate=1, requests=1), plan, schedule={"status": 503})
    errors = [r.error.split(":")[0] for r in sorted(res.records, key=lambda r: r.turn)]
    assert errors == ["http_503", "skipped", "skipped"]


def test_sessions_group_consecutive_turns():
    plan = [_req(0, 0, "a", 0), _req(1, None, "a", 1), _req(2, 1), _req(3, 2, "b", 0)]
    assert [[r.index for r in s] for s in sessions(plan)] == [[0, 1], [2], [3]]


def test_a_stream_goes_on_while_its_last_output_is_counted(url):
    """The client re-count is off the stream's path, and a record goes out only once counted."""
    sent_at_count: list[int] = []
    counts_at_record: list[int | None] = []
    runner: list[PlanRunner] = []

    class CharTokenizer:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            sent_at_count.append(runner[0].sent)
            return [0] * len(text)

        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return ""

    async def go():
        http = HttpClient(url)
        target = Target(url, "test-model", tokenizer=CharTokenizer())
        r = PlanRunner(
            http,
            target,
            LoadSpec(concurrency=1),
            run_tag="t",
            on_record=lambda rec: counts_at_record.append(rec.client_output_tokens),
        )
        runner.append(r)
        res = await r.run([_req(i) for i in range(3)])
        await http.close()
        return res

    res = asyncio.run(go())
    assert len(res.records) == 3 and all(r.ok for r in res.records)
    assert sent_at_count[:2] == [2, 3], "the next request waited for the previous count"
    assert all(c is not None and c > 0 for c in counts_at_record)
    assert [r.client_output_tokens for r in res.records] == counts_at_record


@pytest.mark.parametrize("cold", [False, True])
def test_a_closed_loop_opens_its_connections_before_the_clock_unless_cold(url, cold):
    res = _execute(
        url, LoadSpec(concurrency=4, requests=12), [_req(i) for i in range(12)], cold=cold
    )
    recs = sorted(res.records, key=lambda r: r.actual_send)
    assert len(recs) == 12 and all(r.ok for r in recs)
    c = res.connections
    if cold:  # each stream's first request opens its connection, inside the window
        assert c == {"mode": "cold"}
        assert sum(bool(r.new_connection) for r in recs) == 4
        assert all(r.connect_time is not None for r in recs[:4])
    else:  # all four opened before the clock started; no request waited for one
        assert c is not None and c["mode"] == "warm" and (c["opened"], c["failed"]) == (4, 0)
        assert c["seconds"] > 0 and c["topped_up"] == 0
        assert not any(r.new_connection for r in recs)
        assert all(r.dns_time is None and r.connect_time is None for r in recs)


def test_an_open_loop_warms_its_busiest_second_and_keeps_spares(url):
    # 6 sends in the first 0.1 s, then one every 0.3 s: the busiest second starts 6 or more
    plan = [_req(i, send=0.02 * i) for i in range(6)] + [
        _req(6 + i, send=0.3 + 0.3 * i) for i in range(4)
    ]
    assert busiest_window(plan) == 9 and busiest_window(plan, 0.1) == 5
    res = _execute(url, LoadSpec(rate=10.0, requests=10), plan)
    c = res.connections
    assert c is not None and c["mode"] == "warm" and c["opened"] == c["spare"] == 9
    recs = res.records
    assert len(recs) == 10 and all(r.ok for r in recs)
    assert not any(r.new_connection for r in recs)
