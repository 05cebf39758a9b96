"""The client measures what the deterministic test server really did.

The test server records when it wrote each chunk (same monotonic clock as the client:
one host), and serves those times as timelines. Each client chunk must be stamped
after its write and before the next one, so a wrong reference point, a lost or
merged chunk, a role-only first chunk or a miscounted multi-token chunk shows up.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time

import aiohttp
import pytest

from servelab.bench.client.http import HttpClient, ResponseParser, SSEParser
from servelab.bench.client.send import Target, send
from servelab.rundir import server_id
from servelab.testing.testserver import Schedule, run_test_server
from servelab.testing.tokenizers import one_request
from servelab.vocab import ClientRecord, RequestTags

# Gaps far larger than scheduling noise, so "between write i and write i+1" is a sharp test.
SLOW = Schedule(ttft=0.12, itl=0.04, stall_every=4, stall=0.08)


@pytest.fixture(scope="module")
def url():
    with run_test_server(SLOW) as u:
        yield u


async def _timelines(url: str, ids: list[str]) -> dict[str, dict]:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{url}/v1/timelines", params={"ids": ",".join(ids)}) as r,
    ):
        body = await r.json()
    return {t["request_id"]: t for t in body["timelines"]}


async def _served(url: str) -> dict[str, dict]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/test/requests") as r:
        return {x["id"]: x for x in await r.json()}


_ids = itertools.count()


def _run(
    url,
    n_req,
    max_tokens,
    *,
    endpoint="completions",
    schedule=None,
    strict=False,
    tok=None,
    api_key=None,
    stream=True,
    timeout=30.0,
    concurrent=True,
):
    """Send ``n_req`` requests (concurrently); return records and the server's timelines."""

    async def go():
        http = HttpClient(url)
        target = Target(
            url,
            "test-model",
            endpoint=endpoint,
            strict_openai=strict,
            tokenizer=tok,
            api_key=api_key,
            timeout=timeout,
        )
        if schedule is not None:
            target.extra_headers["X-Test-Schedule"] = json.dumps(schedule)
        tag = next(_ids)
        prompt = [{"role": "user", "content": "hi there"}] if endpoint == "chat" else "hi there"

        async def one(i):
            tags = RequestTags(workload_class="t", stream=stream)
            req = one_request(f"req{tag}-{i}", "hi there", max_tokens, tags=tags)
            return await send(http, target, req, prompt=prompt, intended_send=time.monotonic())

        if concurrent:
            outs = await asyncio.gather(*(one(i) for i in range(n_req)))
        else:
            outs = [await one(i) for i in range(n_req)]
        # The server knows each request by the UUID it was sent; key both by the plan's id.
        ids = {server_id(o.record): o.record.request_id for o in outs}
        tls = {ids[k]: v for k, v in (await _timelines(url, list(ids))).items()}
        served = {ids[k]: v for k, v in (await _served(url)).items() if k in ids}
        await http.close()
        return [o.record for o in outs], tls, served, outs

    return asyncio.run(go())


def _check_against_server(rec: ClientRecord, tl: dict, tokens_per_chunk: int) -> None:
    writes = tl["token_times"][::tokens_per_chunk]
    assert len(rec.chunk_times) == len(writes), "lost or merged chunks"
    assert rec.actual_send <= tl["arrival"], "TTFT measured from after the server got the request"
    assert rec.chunk_times == sorted(rec.chunk_times)
    in_slot = 0
    for i, t in enumerate(rec.chunk_times):
        assert t >= writes[i], f"chunk {i} stamped before the server wrote it"
        in_slot += i + 1 == len(writes) or t < writes[i + 1]
    # Each chunk is stamped before the next write, unless the client was descheduled for
    # longer than a whole gap (a loaded CI machine): allow a few such.
    assert in_slot >= 0.8 * len(writes), "chunks stamped late: wrong reference or attribution"
    assert rec.ttft == pytest.approx(rec.chunk_times[0] - rec.actual_send)
    assert rec.done is not None and rec.done >= rec.chunk_times[-1]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_chunk_times_match_server_writes(url, endpoint, smollm_tok):
    recs, tls, _, outs = _run(url, 6, 9, endpoint=endpoint, tok=smollm_tok)
    for rec, out in zip(recs, outs):
        assert rec.ok, rec.error
        _check_against_server(rec, tls[rec.request_id], 1)
        assert rec.output_tokens == 9 and rec.token_source == "usage"
        assert rec.client_output_tokens == 9 and rec.chunk_tokens == [1] * 9
        assert len(rec.itls) == 8
        assert rec.server_timeline["request_id"] == rec.sent_request_id == rec.server_request_id
        assert len(out.text.split()) == 9


def test_role_only_first_chunk_is_not_ttft(url, smollm_tok):
    # The role chunk goes out at once, TTFT (0.12 s) before the first token.
    recs, tls, _, _ = _run(url, 3, 4, endpoint="chat", tok=smollm_tok)
    for rec in recs:
        tl = tls[rec.request_id]
        assert rec.first_byte < tl["first_token"] <= rec.chunk_times[0]
        assert rec.ttft >= tl["first_token"] - tl["arrival"]


@pytest.mark.parametrize("continuous", [True, False])
def test_multi_token_chunks_are_counted(url, continuous, smollm_tok):
    # 3 tokens per chunk, as speculative decoding sends them. With the server's running
    # usage the count per chunk is exact; without it, the client re-tokenizes.
    sched = {"tokens_per_chunk": 3}
    recs, tls, _, _ = _run(url, 3, 10, schedule=sched, strict=not continuous, tok=smollm_tok)
    for rec in recs:
        assert rec.ok, rec.error
        _check_against_server(rec, tls[rec.request_id], 3)
        assert rec.chunk_tokens == [3, 3, 3, 1]
        assert rec.output_tokens == 10
        assert rec.tpot == pytest.approx((rec.e2e - rec.ttft) / 9)


def test_coalesced_events_and_empty_chunks(url, smollm_tok):
    # Two SSE events per socket write, and a content-less chunk after every token chunk:
    # every token chunk is still seen (sharing its write's timestamp), no empty one is.
    sched = {"coalesce": 2, "empty_chunk_every": 1}
    recs, tls, _, _ = _run(url, 2, 6, schedule=sched, tok=smollm_tok)
    for rec in recs:
        assert rec.ok, rec.error
        assert rec.chunk_tokens == [1] * 6
        writes = tls[rec.request_id]["token_times"]
        assert len(set(writes)) == 3
        for i in range(0, 6, 2):
            assert rec.chunk_times[i] == rec.chunk_times[i + 1] >= writes[i + 1]


def test_errors_timeouts_and_cut_streams_are_recorded(url, smollm_tok):
    fast = {"ttft": 0.05, "itl": 0.05, "stall_every": 0}
    err, _, _, _ = _run(url, 1, 5, schedule={**fast, "status": 500})
    cut, _, _, _ = _run(url, 1, 10, schedule={**fast, "fail_after": 4}, tok=smollm_tok)
    slow, _, _, _ = _run(url, 1, 40, schedule=fast, timeout=0.5, tok=smollm_tok)
    after, _, _, _ = _run(url, 1, 3, schedule=fast)  # the client still works after all that
    assert err[0].error.startswith("http_500: planted error 500") and not err[0].chunk_times
    assert err[0].status == 500
    assert cut[0].error.startswith("partial") and len(cut[0].chunk_times) == 4
    assert cut[0].output_tokens == 4 and cut[0].token_source == "usage"
    assert slow[0].error.startswith("timeout") and 0 < len(slow[0].chunk_times) < 40
    assert after[0].ok


def test_request_fields_headers_and_api_key():
    with run_test_server(Schedule(ttft=0.01, itl=0.005), api_key="s3cret") as url:
        _, _, served, _ = _run(url, 1, 5, api_key="s3cret")
        refused, _, _, _ = _run(url, 1, 5, api_key="wrong")
        _, _, served_strict, _ = _run(url, 1, 5, api_key="s3cret", strict=True)
    (req,) = [v for k, v in served.items() if k.endswith("-0")]
    body = req["body"]
    assert body["min_tokens"] == 5 and body["ignore_eos"] is True and body["max_tokens"] == 5
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    headers = {k.lower(): v for k, v in req["headers"].items()}
    assert headers["x-request-id"] == req["id"] and headers["has_authorization"] == "True"
    assert refused[0].error.startswith("http_401")
    strict = served_strict[max(served_strict)]["body"]
    assert "min_tokens" not in strict and "ignore_eos" not in strict
    assert strict["stream_options"] == {"include_usage": True}


def test_non_streaming_request(url, smollm_tok):
    recs, tls, _, _ = _run(url, 2, 6, stream=False, tok=smollm_tok)
    for rec in recs:
        assert rec.ok and not rec.stream and rec.output_tokens == 6
        assert len(rec.chunk_times) == 1 and rec.chunk_tokens == [6]
        assert rec.ttft == pytest.approx(rec.e2e)  # nothing arrives before the whole answer
        assert rec.done >= tls[rec.request_id]["finished"]


def test_the_test_server_honours_either_name_of_the_output_limit(url):
    """``max_completion_tokens`` (OpenAI's newer chat name) caps an answer like
    ``max_tokens``; with neither the schedule's default (16) applies."""
    import httpx

    got = []
    for limit in ({"max_completion_tokens": 3}, {"max_tokens": 2}, {}):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **limit}
        r = httpx.post(f"{url}/v1/chat/completions", json=body)
        got.append(r.json()["usage"]["completion_tokens"])
    assert got == [3, 2, 16]


def test_keep_alive_connections_are_reused():
    with run_test_server(Schedule(ttft=0.005, itl=0.002)) as url:

        async def go():
            http = HttpClient(url)
            t = Target(url, "m")
            for i in range(5):
                req = one_request(f"k{i}", "x", 3, tags=RequestTags(workload_class="t"))
                out = await send(http, t, req, prompt="x", intended_send=time.monotonic())
                assert out.record.ok
            await http.close()
            return http.connections_opened

        assert asyncio.run(go()) == 1


def test_http_and_sse_parsers_handle_any_split():
    body = b'data: {"a": 1}\n\ndata: {"b": 2}\r\n\r\n: comment\n\ndata: [DONE]\n\n'
    chunked = b"".join(
        b"%x\r\n%s\r\n" % (len(body[i : i + 7]), body[i : i + 7]) for i in range(0, len(body), 7)
    )
    raw = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    raw += chunked + b"0\r\n\r\n"
    for step in (1, 2, 3, 5, 64, len(raw)):
        p, sse, events = ResponseParser(), SSEParser(), []
        for i in range(0, len(raw), step):
            for piece in p.feed(raw[i : i + step]):
                events += sse.feed(piece)
        assert p.done and p.status == 200
        assert events == [b'{"a": 1}', b'{"b": 2}', b"[DONE]"]
    p = ResponseParser()
    assert p.feed(b"HTTP/1.1 404 Not Found\r\nContent-Length: 5\r\n\r\nabc") == [b"abc"]
    assert not p.done and p.feed(b"de") == [b"de"] and p.done


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="kernel receive stamps are Linux-only"
)
def test_kernel_stamps_are_not_delayed_by_a_busy_client(url):
    # The client's loop is blocked from before the first token until well after it; the
    # chunk's stamp must still be its arrival time, not the end of the block.
    async def go():
        http = HttpClient(url)
        target = Target(
            url,
            "m",
            extra_headers={
                "X-Test-Schedule": json.dumps({"ttft": 0.1, "itl": 0.3, "stall_every": 0})
            },
        )

        async def busy():
            await asyncio.sleep(0.03)
            time.sleep(0.3)  # noqa: ASYNC251 -- a client stuck in blocking work

        out, _ = await asyncio.gather(
            send(
                http,
                target,
                one_request(f"busy-{next(_ids)}", "x", 2, tags=RequestTags(workload_class="t")),
                prompt="x",
                intended_send=time.monotonic(),
            ),
            busy(),
        )
        sid = server_id(out.record)
        tls = await _timelines(url, [sid])
        stamps = http.kernel_stamps
        await http.close()
        return out.record, tls[sid], stamps

    rec, tl, kernel = asyncio.run(go())
    assert kernel is True and rec.ok
    assert tl["first_token"] <= rec.chunk_times[0] < tl["first_token"] + 0.1


def test_the_request_id_reaches_the_server_and_its_own_comes_back(url):
    import uuid

    recs, tls, served, _ = _run(url, 3, 4)
    for rec in recs:
        assert uuid.UUID(rec.sent_request_id).version == 4
        headers = {k.lower(): v for k, v in served[rec.request_id]["headers"].items()}
        assert headers["x-request-id"] == rec.sent_request_id
        # the stand-in answers with the id in its X-Request-Id header and its chunks' id
        assert rec.server_request_id == rec.response_id == rec.sent_request_id
        assert tls[rec.request_id]["request_id"] == rec.sent_request_id
    non_streamed, _, _, _ = _run(url, 1, 3, stream=False)
    assert non_streamed[0].response_id == non_streamed[0].sent_request_id


def test_connection_reuse_and_set_up_are_in_the_records(url):
    # A closed loop of one stream over 5 requests: one new connection, then 4 kept-alive ones.
    recs, _, _, _ = _run(url, 5, 3, concurrent=False)
    assert [r.new_connection for r in recs] == [True, False, False, False, False]
    first, *rest = recs
    assert first.dns_time is not None and first.connect_time is not None
    assert first.tls_time is None  # plain HTTP
    assert all(r.dns_time is None and r.connect_time is None for r in rest)
    for r in recs:
        assert r.actual_send <= r.connected <= r.request_written <= r.chunk_times[0]
        parts = r.connection_wait + r.send_time + r.server_to_first_token
        assert parts == pytest.approx(r.ttft)
    assert first.connection_wait >= first.connect_time
    assert all(r.connection_wait < first.connection_wait for r in rest)


def test_a_class_temperature_is_sent_over_the_runs_sampling(smollm_tok):
    from servelab.bench.client.send import request_body
    from servelab.bench.workloads.request_plan import LoadSpec, build_plan
    from servelab.bench.workloads.spec import parse_workload

    spec = parse_workload(
        {
            "classes": [
                {"name": "edit", "input": {"dist": "fixed", "value": 8},
                 "output": {"dist": "fixed", "value": 4}, "temperature": 0.0},
                {"name": "chat", "input": {"dist": "fixed", "value": 8},
                 "output": {"dist": "fixed", "value": 4}},
            ]
        }
    )  # fmt: skip
    plan = build_plan(spec, LoadSpec(concurrency=1, requests=12), seed=0, tokenizer=smollm_tok)
    target = Target("http://x", "m", extra_body={"temperature": 0.7, "top_p": 0.9})
    temps = {r.tags.workload_class: request_body(target, r, "p")["temperature"] for r in plan}
    # The edit class's own 0 wins over --sampling; chat keeps the run's; the rest is kept.
    assert temps == {"edit": 0.0, "chat": 0.7}
    assert all(request_body(target, r, "p")["top_p"] == 0.9 for r in plan)
    # Without either, the server's default: no temperature is sent.
    chat = next(r for r in plan if r.tags.workload_class == "chat")
    assert "temperature" not in request_body(Target("http://x", "m"), chat, "p")


@pytest.mark.parametrize("continuous", [True, False])
def test_a_stream_ends_at_done_and_what_follows_is_ignored(url, continuous):
    # the server sends 2 more token chunks (with a usage one higher) after data: [DONE]
    recs, tls, _, outs = _run(url, 2, 4, schedule={"after_done": 2}, strict=not continuous)
    for r, out in zip(recs, outs):
        tl = tls[r.request_id]
        assert r.ok and r.output_tokens == 4 and sum(r.chunk_tokens) == 4
        assert len(r.chunk_times) == 4 and out.text.count(" ") == 4
        # done: the [DONE] event, before the extra chunks (an ITL apart) reached the client
        assert r.done is not None and tl["finished"] <= r.done < tl["finished"] + SLOW.itl


def test_the_run_warns_once_about_streams_past_done():
    with run_test_server(Schedule(ttft=0.005, itl=0.002, after_done=1)) as url:

        async def go():
            http = HttpClient(url)
            t = Target(url, "m")
            for i in range(3):
                req = one_request(f"d{i}", "x", 3, tags=RequestTags(workload_class="t"))
                out = await send(http, t, req, prompt="x", intended_send=time.monotonic())
                assert out.record.ok and out.record.output_tokens == 3
            await http.close()
            return t.streams_past_done, http.connections_opened

        # every stream is counted; the connection is still reused (the body ended cleanly)
        assert asyncio.run(go()) == (3, 1)


def test_a_warm_pool_opens_before_and_tops_up_its_spares_in_the_background():
    with run_test_server(Schedule(ttft=0.005, itl=0.002)) as url:

        async def go():
            http = HttpClient(url)
            t = Target(url, "m")
            set_up = await http.warm(2, spare=2)
            recs = []
            for i in range(3):
                req = one_request(f"w{i}", "x", 3, tags=RequestTags(workload_class="t"))
                recs.append((await send(http, t, req, prompt="x", intended_send=0.0)).record)
            again = await http.warm(2)  # a later stage: what is open already counts
            await http.cold()
            return set_up, recs, again, http.topped_up, http.connections_opened

        set_up, recs, again, topped, opened = asyncio.run(go())
    assert (set_up["kept"], set_up["opened"], set_up["failed"]) == (0, 2, 0)
    assert all(r.ok and r.new_connection is False for r in recs)
    # the first request left one idle (fewer than 2 spare): one more opened in the background
    assert topped == 1 and opened == 3
    assert (again["kept"], again["opened"]) == (3, 0)
