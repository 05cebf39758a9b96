"""The stamp server's ground truth: a request's clock starts at the kernel's receipt of it, not
when the server's event loop reads it; and it still serves the bench's streams."""

from __future__ import annotations

import asyncio
import http.client
import json
import sys
import threading
import time
from urllib.parse import urlsplit

import pytest

from servelab.bench.client.http import HttpClient
from servelab.bench.client.send import Target
from servelab.bench.plan_runner import PlanRunner
from servelab.bench.workloads.request_plan import LoadSpec
from servelab.rundir import server_id
from servelab.testing.stampserver import StampServer
from servelab.testing.testserver import Schedule, TestServer, run_test_server
from servelab.testing.tokenizers import one_request
from servelab.vocab import RequestTags

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="kernel receive stamps are Linux's"
)


def _post(conn: http.client.HTTPConnection, rid: str) -> bytes:
    body = {"model": "m", "prompt": "hi there", "max_tokens": 3, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"X-Request-Id": rid})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    return resp.read()


def _get(conn: http.client.HTTPConnection, path: str) -> dict:
    conn.request("GET", path)
    return json.loads(conn.getresponse().read())


def test_the_kernel_stamps_a_request_the_busy_loop_reads_late():
    server = StampServer(TestServer(Schedule(ttft=0.01, itl=0.002)))
    with server.running() as url:
        u = urlsplit(url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        assert _post(conn, "warm").endswith(b"data: [DONE]\n\n")  # a kept-alive connection

        # Keep the server's loop busy from before the request is sent until 50 ms after.
        busy, sent = threading.Event(), threading.Event()

        def block() -> None:
            busy.set()
            sent.wait(10)
            time.sleep(0.05)

        assert server.loop is not None
        server.loop.call_soon_threadsafe(block)
        assert busy.wait(10)
        before = time.monotonic()
        body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 3, "stream": True})
        conn.request("POST", "/v1/completions", body, {"X-Request-Id": "late"})
        after = time.monotonic()
        sent.set()
        stream = conn.getresponse().read()
        assert stream.count(b'"text"') == 3 and stream.endswith(b"data: [DONE]\n\n")

        arrivals = _get(conn, "/test/arrivals?ids=warm,late")
        tls = {t["request_id"]: t for t in _get(conn, "/v1/timelines?ids=late")["timelines"]}
    late = arrivals["late"]
    assert "kernel" in arrivals["warm"] and "kernel" in late, "no kernel receive stamp"
    for a in arrivals.values():
        assert a["kernel"] <= a["read"]
    # On loopback the kernel receives within the client's send; the loop reads after its block.
    assert before - 1e-3 <= late["kernel"] <= after + 1e-3
    assert late["read"] - late["kernel"] >= 0.04, "the busy loop's delay is in the kernel stamp"
    assert tls["late"]["arrival"] == late["kernel"], "the timeline starts at the loop's read"
    assert tls["late"]["first_token"] >= late["read"]


def test_the_aiohttp_server_keeps_the_event_loop_stamp():
    with TestServer(Schedule(ttft=0.01, itl=0.002)).running() as url:
        u = urlsplit(url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        _post(conn, "r")
        arrivals = _get(conn, "/test/arrivals?ids=r")
        tl = _get(conn, "/v1/timelines?ids=r")["timelines"][0]
    assert set(arrivals["r"]) == {"read"} and tl["arrival"] == arrivals["r"]["read"]


@pytest.mark.parametrize("warm", [True, False])
def test_the_bench_runs_against_the_stamp_server(warm):
    # A short closed loop as `client_accuracy --join` runs it: the stamp server out of process.
    streams, rounds, tokens = 4, 2, 5
    sched = Schedule(ttft=0.02, itl=0.005)

    async def bench(url: str) -> list:
        http_client = HttpClient(url)
        target = Target(url, "test-model", cold_connections=not warm)
        plan = [
            one_request(f"s{i}", "hello", tokens, tags=RequestTags(workload_class="x"))
            for i in range(streams * rounds)
        ]
        load = LoadSpec(concurrency=streams, requests=len(plan))
        res = await PlanRunner(http_client, target, load, run_tag="stamp").run(plan)
        await http_client.close()
        return res.records

    with run_test_server(sched, kernel_stamps=True) as url:
        recs = asyncio.run(bench(url))
        ids = ",".join(server_id(r) for r in recs)
        u = urlsplit(url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        arrivals = _get(conn, f"/test/arrivals?ids={ids}")
        tls = {t["request_id"]: t for t in _get(conn, f"/v1/timelines?ids={ids}")["timelines"]}
    assert len(recs) == streams * rounds
    assert sum(bool(r.new_connection) for r in recs) == (0 if warm else streams)
    for r in recs:
        assert r.ok, r.error
        assert r.output_tokens == tokens and r.token_source == "usage"
        tl, a = tls[server_id(r)], arrivals[server_id(r)]
        assert "kernel" in a and tl["arrival"] == a["kernel"] <= a["read"]
        assert r.actual_send <= a["kernel"], "the server's clock started before the client sent"
        writes = tl["token_times"]
        assert len(r.chunk_times) == len(writes) == tokens
        assert all(t >= w for t, w in zip(r.chunk_times, writes)), "stamped before written"
        assert r.ttft >= tl["first_token"] - tl["arrival"]
