"""The API and engine-core processes over real HTTP and IPC, with a model-free engine.

The engine is the real LLMEngine with the tiny model's real tokenizer; only the executor
is the engine tests' FakeExecutor (see server_fakes.fake_engine). So this checks the
HTTP layer, the SSE format, errors, metrics, timelines, aborts and faults quickly; the
end-to-end tests with weights are in test_server_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import (
    ServerThread,
    metrics,
    newest_core_pid,
    serving,
    storm_leaves_no_trace,
    wait_idle,
)

from servelab.modelcore.tokenizer import Tokenizer

SSE_RE = re.compile(rb"^(data: [^\n]+\n\n)*data: \[DONE\]\n\n$")


def sse_events(body: bytes) -> list[Any]:
    """Check the exact SSE framing and return the JSON payloads (without [DONE])."""
    assert SSE_RE.match(body), body[-300:]
    parts = body.split(b"\n\n")
    assert parts[-1] == b"" and parts[-2] == b"data: [DONE]"
    return [json.loads(p[len(b"data: ") :]) for p in parts[:-2]]


def stream_post(http: httpx.Client, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    with http.stream("POST", path, json={**body, "stream": True}, **kw) as r:
        r.read()
    return r


# ---- responses ----


def test_completion_usage_matches_tokenizer_and_echoes_request_id(
    http: httpx.Client, tiny_tok: Tokenizer
) -> None:
    prompt = "The quick brown fox jumps over the lazy dog."
    r = http.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 7, "ignore_eos": True},
        headers={"X-Request-Id": "usage-1"},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert r.headers["X-Request-Id"] == "usage-1" and body["id"] == "cmpl-usage-1"
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["usage"] == {
        "prompt_tokens": len(tiny_tok.encode(prompt, add_special_tokens=True)),
        "completion_tokens": 7,
        "total_tokens": len(tiny_tok.encode(prompt, add_special_tokens=True)) + 7,
    }
    assert body["choices"][0]["finish_reason"] == "length"
    timing = body["servelab"]
    assert timing["request_id"] == "usage-1" and timing["finish_reason"] == "length"
    assert sum(c[0] for c in timing["prefill_chunks"]) == body["usage"]["prompt_tokens"]
    # A colliding id is made unique, and the response says which id it got.
    r2 = http.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": 1},
        headers={"X-Request-Id": "usage-1"},
    )
    assert r2.headers["X-Request-Id"] == "usage-1-1"


def test_token_id_prompt_and_stop_strings(http: httpx.Client, tiny_tok: Tokenizer) -> None:
    ids = tiny_tok.encode("Hello world")
    base = {"prompt": ids, "max_tokens": 30, "ignore_eos": True, "temperature": 0}
    full = http.post("/v1/completions", json=base).json()
    assert full["usage"]["prompt_tokens"] == len(ids)
    text = full["choices"][0]["text"]
    stop = text[5:8] if len(text) >= 8 else None
    if stop and stop.strip():
        cut = http.post("/v1/completions", json={**base, "stop": [stop]}).json()
        assert cut["choices"][0]["finish_reason"] == "stop"
        assert cut["choices"][0]["text"] == text[: text.index(stop)]


def test_stream_sse_format_first_token_usage_and_timeline(
    http: httpx.Client, tiny_tok: Tokenizer
) -> None:
    messages = [{"role": "user", "content": "Hello world! How are you today?"}]
    body = {
        "messages": messages,
        "max_tokens": 9,
        "ignore_eos": True,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    r = stream_post(http, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
    events = sse_events(r.content)
    token_events, usage_event = events[:-1], events[-1]
    # The first event already carries the first token, with the role: no role-only chunk.
    first = token_events[0]["choices"][0]["delta"]
    assert first["role"] == "assistant" and "content" in first
    assert all("role" not in e["choices"][0]["delta"] for e in token_events[1:])
    assert [e["choices"][0]["finish_reason"] for e in token_events] == [None] * (
        len(token_events) - 1
    ) + ["length"]
    assert 1 <= len(token_events) <= 9
    prompt_tokens = len(tiny_tok.encode(tiny_tok.apply_chat_template(messages)))
    assert usage_event["choices"] == []
    assert usage_event["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 9,
        "total_tokens": prompt_tokens + 9,
    }
    assert usage_event["servelab"]["finish_reason"] == "length"
    assert all(
        e["id"] == usage_event["id"] and e["object"] == "chat.completion.chunk" for e in events
    )
    # Streaming and non-streaming produce the same greedy text.
    streamed = "".join(e["choices"][0]["delta"]["content"] for e in token_events)
    whole = http.post("/v1/chat/completions", json={**body, "stream_options": None}).json()
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": streamed}


def test_stream_without_usage_puts_timeline_in_the_finish_chunk(http: httpx.Client) -> None:
    r = stream_post(
        http, "/v1/completions", {"prompt": "A paged KV cache", "max_tokens": 4, "ignore_eos": True}
    )
    events = sse_events(r.content)
    assert all("usage" not in e for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["servelab"]["request_id"] == r.headers["X-Request-Id"]
    assert all("servelab" not in e for e in events[:-1])


def test_models_health_version_reset(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/v1/models").json()["data"][0]["id"] == "tiny"
    version = http.get("/version").json()
    assert version["version"]
    assert version["engine"]["max_model_len"] == 512 and version["engine"]["block_size"] == 16
    assert "pid" not in version["engine"]
    # The kernels' build the core's model runs on (q4_1's numerics follow it): none here,
    # where the executor is a fake (test_disagg_server checks real workers).
    assert version["engine"]["cpu_kernels"] == ""
    r = http.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"reset": True}


def test_timelines_filters(http: httpx.Client) -> None:
    for rid in ("tl-a", "tl-b"):
        http.post(
            "/v1/completions",
            json={"prompt": "Hello", "max_tokens": 3},
            headers={"X-Request-Id": rid},
        )
    data = http.get("/v1/timelines", params={"ids": "tl-a,tl-b,unknown"}).json()
    assert [t["request_id"] for t in data["timelines"]] == ["tl-a", "tl-b"]
    assert all(
        t["finish_reason"] in ("stop", "length") and t["finished"] for t in data["timelines"]
    )
    last = data["steps"][-1]["step_id"]
    assert http.get("/v1/timelines", params={"ids": "", "since_step": last}).json()["steps"] == []
    some = http.get("/v1/timelines", params={"since_step": last - 2}).json()["steps"]
    assert [s["step_id"] for s in some] == [last - 1, last]
    assert http.get("/v1/timelines", params={"since_step": "x"}).status_code == 400


# ---- bad input ----


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt"),
        ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        (
            "/v1/completions",
            {"prompt": "x", "stream_options": {"include_usage": True}},
            400,
            "stream_options",
        ),
        ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user"}], "max_completion_tokens": 0},
            400,
            "max_tokens",
        ),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
        ("/v1/nope", {}, 404, None),
    ],
)
def test_bad_requests_get_openai_errors(
    http: httpx.Client, path: str, body: Any, status: int, param: str | None
) -> None:
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = http.post(path, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_context_overflow_states_the_limits(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "Hello world", "max_tokens": 600})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "512" in msg and "600" in msg
    # The same check applies before a stream starts: an error status, not a 200 stream.
    assert (
        stream_post(http, "/v1/completions", {"prompt": "Hello", "max_tokens": 600}).status_code
        == 400
    )
    # Chat without max_tokens gets the rest of the context.
    r = http.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            "ignore_eos": True,
            "max_tokens": None,
            "temperature": 0,
            "stop_token_ids": [5],
        },
    )
    assert r.status_code == 200


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "n",
    "stream",
    "stream_options",
    "priority",
    "logprobs",
    "echo",
    "best_of",
    "response_format",
    "logit_bias",
    "tools",
    "add_special_tokens",
]
VALID_CORE = {"prompt": "Hello", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    fields=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6),
    keep_valid=st.booleans(),
    raw=st.none() | st.binary(max_size=40),
)
def test_fuzzed_requests_never_5xx(
    http: httpx.Client, path: str, fields: dict[str, Any], keep_valid: bool, raw: bytes | None
) -> None:
    if raw is not None:
        r = http.post(path, content=raw)
    else:
        body = {**VALID_CORE, **fields} if keep_valid else fields
        if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 64:
            body["max_tokens"] = 64  # keep valid requests short
        # json.dumps writes inf as Infinity, which is not JSON: the server must say so.
        r = http.post(path, content=json.dumps(body), timeout=30)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_server_survives_the_fuzz(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"prompt": "Still alive?", "max_tokens": 2})
    assert r.status_code == 200


# ---- metrics ----


def test_metrics_counters_agree_with_requests(http: httpx.Client) -> None:
    before = wait_idle(http)
    prompts = ["Hello world", "Numbers like 12345", "Unicode text"]
    usages = [
        http.post(
            "/v1/completions", json={"prompt": p, "max_tokens": 5, "ignore_eos": True}
        ).json()["usage"]
        for p in prompts
    ]
    after = wait_idle(http)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert (
        delta("vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usages) == 15
    )
    assert delta("vllm:request_success_total{finished_reason=length}") == 3
    for hist in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
    ):
        assert delta(f"vllm:{hist}_count") == 3, hist
    assert delta("vllm:inter_token_latency_seconds_count") == 3 * 4
    assert delta("vllm:prefix_cache_queries_total") >= sum(u["prompt_tokens"] for u in usages)
    assert after["vllm:kv_cache_usage_perc"] == 0 and after["servelab:kv_cache_blocks_used"] == 0
    assert delta("servelab:api_to_core_seconds_count") == 3
    assert delta("servelab:step_duration_seconds_count") >= 5


# ---- disconnects ----


def test_client_disconnect_aborts_and_frees_kv(http: httpx.Client, server: ServerThread) -> None:
    with http.stream(
        "POST",
        "/v1/completions",
        json={"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True},
        headers={"X-Request-Id": "gone"},
    ) as r:
        lines = r.iter_lines()
        next(lines)
        busy = metrics(http)
        assert busy["servelab:kv_cache_blocks_used"] > 0 and busy["vllm:num_requests_running"] == 1
    m = wait_idle(http, timeout=10)
    assert m["servelab:kv_cache_blocks_used"] == 0
    tl = http.get("/v1/timelines", params={"ids": "gone"}).json()["timelines"]
    assert tl and tl[0]["finish_reason"] == "abort" and 0 < tl[0]["output_tokens"] < 400


def test_storm_with_random_disconnects_leaves_every_block_free(http: httpx.Client) -> None:
    storm_leaves_no_trace(http, n=200)


# ---- faults, overload, auth, shutdown (own servers) ----


def test_api_key_required_on_v1_routes(tiny_llama_dir: Path) -> None:
    with (
        serving(tiny_llama_dir, api_key="s3cret-key") as srv,
        httpx.Client(base_url=srv.url) as http,
    ):
        body = {"prompt": "Hello", "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 401
        r = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "s3cret" not in r.text
        assert (
            http.post(
                "/v1/completions", json=body, headers={"Authorization": "Bearer s3cret-key"}
            ).status_code
            == 200
        )
        assert http.get("/health").status_code == 200  # probes need no key, as in vLLM
        assert http.get("/metrics").status_code == 200


def test_full_queue_answers_429_with_retry_after(tiny_llama_dir: Path) -> None:
    with (
        serving(tiny_llama_dir, max_queue=2, max_num_seqs=1) as srv,
        httpx.Client(base_url=srv.url) as http,
    ):

        async def run() -> tuple[list[int], httpx.Response]:
            body = {"prompt": "Hello", "max_tokens": 100, "ignore_eos": True}
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
                tasks = []
                for waiting in (0, 1, 2):  # one runs, then two wait: the queue is full
                    tasks.append(asyncio.create_task(client.post("/v1/completions", json=body)))
                    while metrics(http)["vllm:num_requests_waiting"] < waiting:
                        await asyncio.sleep(0.01)
                rejected = await client.post("/v1/completions", json=body)
                return [r.status_code for r in await asyncio.gather(*tasks)], rejected

        statuses, rejected = asyncio.run(run())
        assert statuses == [200, 200, 200]
        assert rejected.status_code == 429 and rejected.headers["Retry-After"] == "1"
        assert rejected.json()["error"]["code"] == "queue_full"
        assert (
            http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
        )


def test_engine_core_death_fails_requests_and_health(tiny_llama_dir: Path) -> None:
    with serving(tiny_llama_dir) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        body = {"prompt": "Hello", "max_tokens": 450, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            psutil.Process(newest_core_pid()).send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            rest = [line for line in lines if line]
            took = time.monotonic() - t0
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["error"]["code"] == "engine_dead"
        assert took < 5
        assert http.get("/health").status_code == 503
        r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 503 and "exited" in r.json()["error"]["message"]


def test_shutdown_lets_streams_finish(tiny_llama_dir: Path) -> None:
    with serving(tiny_llama_dir) as srv:

        async def run() -> bytes:
            body = {"prompt": "Hello", "max_tokens": 80, "ignore_eos": True, "stream": True}
            async with (
                aiohttp.ClientSession() as s,
                s.post(f"{srv.url}/v1/completions", json=body) as r,
            ):
                await r.content.readline()
                await asyncio.to_thread(srv.stop)  # like SIGTERM: stop while the stream runs
                return await r.read()

        rest = asyncio.run(run())
        assert srv.exit_code == 0
        assert rest.endswith(b"data: [DONE]\n\n")
        assert b'"finish_reason":"length"' in rest
