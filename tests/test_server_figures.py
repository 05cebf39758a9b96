"""Other servers' per-request figures: read by capability into the record's server side."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from aiohttp import web

from servelab.bench.client.http import HttpClient
from servelab.bench.client.send import Target, send
from servelab.bench.client.serverfigures import (
    LLAMACPP,
    SGLANG,
    VLLM,
    MalformedFigures,
    figures_from,
)
from servelab.testing.testserver import Schedule, TestServer
from servelab.testing.tokenizers import one_request
from servelab.vocab import RequestTags


def _send(schedule: Schedule, stream: bool = True, n: int = 3):
    async def go():
        http = HttpClient(url)
        target = Target(url, "test-model", timeout=20.0)
        tags = RequestTags(workload_class="chat", stream=stream)
        try:
            outs = [
                await send(
                    http,
                    target,
                    one_request(f"r{k}", "hello there", 6, tags=tags),
                    prompt="hello there",
                    intended_send=time.monotonic(),
                )
                for k in range(n)
            ]
        finally:
            await http.close()
        return [o.record for o in outs]

    with TestServer(schedule).running() as url:
        return asyncio.run(go())


@pytest.mark.parametrize("stream", [True, False])
def test_vllm_metrics_become_queue_prefill_and_decode(stream):
    recs = _send(Schedule(ttft=0.12, queue=0.05, itl=0.01, report="vllm"), stream=stream)
    for r in recs:
        assert r.ok
        s = r.server_timeline
        assert s["reported_by"] == VLLM
        assert s["queue_time"] == pytest.approx(0.05, abs=0.01)
        if stream:  # a whole response's "first token" is its last
            assert s["prefill_time"] == pytest.approx(0.07, abs=0.02)
        # The server's figures sit inside what the client measured.
        assert s["queue_time"] + s["prefill_time"] <= r.ttft + 1e-3
        assert s["decode_time"] >= 0.0 and s["mean_itl"] >= 0.0


def test_llamacpp_timings_give_prefill_but_no_queue():
    (r,) = _send(Schedule(ttft=0.08, report="llamacpp"), n=1)
    s = r.server_timeline
    assert s["reported_by"] == LLAMACPP
    assert "queue_time" not in s and s["prefill_time"] > 0.0
    assert s["prompt_tokens_computed"] == 2 and s["cached_prompt_tokens"] == 0


def test_malformed_figures_are_ignored_and_the_request_is_ok():
    recs = _send(Schedule(report="malformed"), n=2)
    for r in recs:
        assert r.ok and r.chunk_times
        assert r.server_timeline["reported_by"] == "ignored"
        assert "queue_time_ms" in r.server_timeline["ignored"]


def test_a_server_with_no_figures_is_handled_as_before():
    (r,) = _send(Schedule(report="none"), n=1)
    assert r.ok and r.server_timeline is None


@pytest.mark.parametrize(
    "objects",
    [
        {"metrics": "fast"},
        {"metrics": {"queue_time_ms": -3}},
        {"timings": {"prompt_ms": float("nan")}},
        {"meta_info": {"queue_time": True}},
    ],
)
def test_bad_fields_raise_one_error_type(objects):
    with pytest.raises(MalformedFigures):
        figures_from(objects)


def test_sglang_prefill_is_the_span_between_its_two_stamps():
    sg = figures_from(
        {"meta_info": {"forward_entry_time": 1754.25, "prefill_finished_time": 1754.5}}
    )
    assert sg == {"prefill_time": 0.25, "reported_by": "sglang meta_info"}
    with pytest.raises(MalformedFigures, match="before"):
        figures_from({"meta_info": {"forward_entry_time": 2.0, "prefill_finished_time": 1.0}})


def test_unknown_fields_only_are_no_figures():
    assert figures_from({"metrics": {"speculative_decoding": None}, "meta_info": {}}) is None
    sg = figures_from({"meta_info": {"queue_time": 0.25, "cached_tokens": 64}})
    assert sg == {"queue_time": 0.25, "cached_prompt_tokens": 64, "reported_by": "sglang meta_info"}


# ---------------------------------------------------------------- recorded from vLLM 0.32 CPU
# tests/fixtures/vllm/: what vLLM 0.32 (CPU build, --enable-per-request-metrics, SmolLM2-135M
# exported by `servelab export-hf`) sent, replayed byte for byte over HTTP to the client.
FIXTURES = Path(__file__).parent / "fixtures" / "vllm"


def _replay(name: str, endpoint: str, stream: bool):
    return _replay_body((FIXTURES / name).read_bytes(), endpoint, stream)


def _replay_body(body: bytes, endpoint: str, stream: bool):
    async def handler(request: web.Request) -> web.StreamResponse:
        if not stream:
            return web.Response(body=body, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in body.split(b"\n\n" if b"\n\n" in body else b"\n"):
            if event.strip():
                await resp.write(event.strip() + b"\n\n")
        await resp.write_eof()
        return resp

    async def go():
        app = web.Application()
        app.router.add_post("/v1/{path:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}"
        http = HttpClient(url)
        try:
            out = await send(
                http,
                Target(url, "smollm2-135m", endpoint=endpoint, timeout=20.0),
                one_request(
                    "r0", "hello", 8, tags=RequestTags(workload_class="chat", stream=stream)
                ),
                prompt="hello",
                intended_send=time.monotonic(),
            )
        finally:
            await http.close()
            await runner.cleanup()
        return out.record

    return asyncio.run(go())


def _final_metrics(name: str) -> dict:
    for line in (FIXTURES / name).read_text().splitlines():
        if line.startswith("data: {") and '"metrics"' in line:
            return json.loads(line[6:])["metrics"]
    raise AssertionError(f"no metrics in {name}")


@pytest.mark.parametrize(
    ("name", "endpoint"), [("stream_chat.sse", "chat"), ("stream_completion.sse", "completions")]
)
def test_recorded_vllm_stream_gives_its_metrics_in_our_vocabulary(name, endpoint):
    rec = _replay(name, endpoint, stream=True)
    m = _final_metrics(name)
    assert rec.ok and rec.error is None
    # The role-only first chunk carries no token; the usage chunk carries no text.
    assert sum(rec.chunk_tokens) == rec.output_tokens == len(rec.chunk_times)
    s = rec.server_timeline
    assert s["reported_by"] == VLLM
    assert s["queue_time"] == pytest.approx(m["queue_time_ms"] / 1e3)
    assert s["prefill_time"] == pytest.approx(m["time_to_first_token_ms"] / 1e3)
    assert s["decode_time"] == pytest.approx(m["generation_time_ms"] / 1e3)
    assert s["mean_itl"] == pytest.approx(m["mean_itl_ms"] / 1e3)
    # vLLM's own figures are consistent: mean ITL x (tokens - 1) is the generation time.
    assert s["mean_itl"] * (rec.output_tokens - 1) == pytest.approx(s["decode_time"], rel=1e-6)


def test_recorded_vllm_whole_response_gives_its_metrics():
    rec = _replay("completion.json", "completions", stream=False)
    m = json.loads((FIXTURES / "completion.json").read_text())["metrics"]
    assert rec.ok and rec.output_tokens == 6
    s = rec.server_timeline
    assert s["reported_by"] == VLLM and "speculative_decoding" not in s
    assert s["queue_time"] == pytest.approx(m["queue_time_ms"] / 1e3)
    assert s["prefill_time"] == pytest.approx(m["time_to_first_token_ms"] / 1e3)


# ------------------------------------------------ SGLang and llama.cpp, in their sources' shapes
# Built field for field from the source the field names were checked against
# (docs/metrics.md): SGLang's ChatCompletionResponse with return_meta_info (meta_info on
# the choice, --enable-metrics stamps), llama.cpp's streamed chat with include_usage
# (result_timings::to_json on the last chunk, the usage chunk).
SGLANG_CHAT = {
    "id": "5c1f",
    "object": "chat.completion",
    "created": 1754000000,
    "model": "smollm2-135m",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "one two three four"},
            "finish_reason": "length",
            "matched_stop": None,
            "meta_info": {
                "id": "5c1f",
                "finish_reason": {"type": "length", "length": 4},
                "prompt_tokens": 9,
                "weight_version": "default",
                "num_retractions": 0,
                "forward_entry_time": 1754000000.25,
                "prefill_finished_time": 1754000000.375,
                "queue_time": 0.0125,
                "prefill_waiting_latency": None,
                "prefill_launch_latency": None,
                "reasoning_tokens": 0,
                "completion_tokens": 4,
                "cached_tokens": 8,
                "e2e_latency": 0.5,
            },
        }
    ],
    "usage": {"prompt_tokens": 9, "total_tokens": 13, "completion_tokens": 4},
    "metadata": {"weight_version": "default"},
}


def test_sglang_meta_info_on_the_choice_of_a_whole_chat_response():
    rec = _replay_body(json.dumps(SGLANG_CHAT).encode(), "chat", stream=False)
    assert rec.ok and rec.output_tokens == 4
    assert rec.server_timeline == {
        "queue_time": 0.0125,
        "cached_prompt_tokens": 8,
        "e2e_time": 0.5,
        "prefill_time": pytest.approx(0.125),
        "reported_by": SGLANG,
    }


def _llamacpp_stream() -> bytes:
    base = {
        "id": "chatcmpl-x",
        "created": 1,
        "model": "m",
        "system_fingerprint": "b1-0",
        "object": "chat.completion.chunk",
    }
    events = [
        {
            "choices": [
                {"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}
            ]
        }
    ]
    events += [
        {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": w}}]}
        for w in ("one", " two", " three")
    ]
    events.append({"choices": [{"finish_reason": "length", "index": 0, "delta": {}}]})
    timings = {
        "cache_n": 5,
        "prompt_n": 4,
        "prompt_ms": 32.5,
        "prompt_per_token_ms": 8.125,
        "prompt_per_second": 123.1,
        "predicted_n": 3,
        "predicted_ms": 20.0,
        "predicted_per_token_ms": 6.667,
        "predicted_per_second": 150.0,
    }
    usage = {"completion_tokens": 3, "prompt_tokens": 9, "total_tokens": 12}
    events.append({"choices": [], "usage": usage, "timings": timings})
    lines = [b"data: " + json.dumps(base | e).encode() for e in events] + [b"data: [DONE]"]
    return b"\n\n".join(lines) + b"\n\n"


def test_llamacpp_timings_on_the_usage_chunk_of_a_stream():
    rec = _replay_body(_llamacpp_stream(), "chat", stream=True)
    assert rec.ok and rec.output_tokens == 3 and len(rec.chunk_times) == 3
    assert rec.server_timeline == {
        "prefill_time": pytest.approx(0.0325),
        "decode_time": pytest.approx(0.02),
        "prompt_tokens_computed": 4,
        "cached_prompt_tokens": 5,
        "reported_by": LLAMACPP,
    }
