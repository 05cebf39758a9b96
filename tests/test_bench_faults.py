"""A misbehaving stand-in server: what the bench counts when a server streams nothing,
does not stream, or claims tokens its stream cannot have carried; what output tokens/s
counts; and how the progress line, time windows and closed-loop rates print."""

from __future__ import annotations

import asyncio
import io
import json

import pytest
from rich.console import Console

from servelab.analyze.summary import summarize
from servelab.bench.client.http import HttpClient
from servelab.bench.client.send import Target, send
from servelab.bench.client.usagecheck import usage_plausible
from servelab.bench.progress import Progress
from servelab.report.terminal import rates_table, saturation_line, slices_table
from servelab.testing.testserver import Schedule, TestServer
from servelab.testing.tokenizers import one_request, tiny_tokenizer
from servelab.vocab import ClientRecord, RequestTags


@pytest.fixture(scope="module")
def url():
    with TestServer(Schedule(ttft=0.01, itl=0.002)).running() as u:
        yield u


def _send(url, fault: dict, *, max_tokens=16, tok=None, strict=False, endpoint="completions"):
    async def go():
        http = HttpClient(url)
        target = Target(
            url=url,
            model="test-model",
            endpoint=endpoint,
            strict_openai=strict,
            timeout=10.0,
            tokenizer=tok,
            extra_headers={"X-Test-Schedule": json.dumps(fault)},
        )
        try:
            prompt = [{"role": "user", "content": "hello there"}] if endpoint == "chat" else "hello"
            req = one_request("r-0", "hello", max_tokens, tags=RequestTags(workload_class="c"))
            out = await send(http, target, req, prompt=prompt, intended_send=0.0)
        finally:
            await http.close()
        return out.record

    return asyncio.run(go())


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_stream_with_done_and_no_token_is_a_failed_request(url, endpoint):
    rec = _send(url, {"no_tokens": True}, endpoint=endpoint)
    assert not rec.ok and rec.status == 200
    assert rec.error.startswith("no_output: ")
    assert rec.chunk_times == [] and rec.output_tokens == 0


def test_a_json_answer_to_a_stream_request_says_the_server_did_not_stream(url):
    rec = _send(url, {"ignore_stream": True})
    assert rec.error == "not_streamed: server did not stream: answered application/json"
    assert not rec.ok


@pytest.mark.parametrize(
    "strict", [False, True]
)  # running usage in every chunk, or only at the end
def test_a_usage_the_stream_disproves_is_flagged_and_the_recount_used(url, strict):
    tok = tiny_tokenizer()
    fault = {"tokens_per_chunk": 2, "usage_factor": 50}  # 16 tokens in 8 chunks, 800 claimed
    rec = _send(url, fault, tok=tok, strict=strict)
    assert rec.ok and len(rec.chunk_times) == 8
    assert rec.disputed_usage == 800 and rec.token_source == "client"
    assert rec.output_tokens == rec.client_output_tokens < 100
    assert sum(rec.chunk_tokens) == rec.output_tokens
    # without a tokenizer: one token per chunk, the count the stream proves
    bare = _send(url, fault, strict=strict)
    assert bare.disputed_usage == 800 and bare.output_tokens == 8 == sum(bare.chunk_tokens)


def test_a_usage_within_the_bounds_is_believed(url):
    rec = _send(url, {"tokens_per_chunk": 4, "usage_factor": 1.5}, tok=tiny_tokenizer())
    assert rec.ok and rec.disputed_usage is None
    assert rec.token_source == "usage" and rec.output_tokens == 24


def test_the_plausibility_rule():
    assert usage_plausible(16, chunks=8, recount=16)
    assert usage_plausible(8 * 16 + 8, chunks=8, recount=None)  # deep speculative chunks
    assert not usage_plausible(8 * 16 + 9, chunks=8, recount=None)
    assert not usage_plausible(800, chunks=8, recount=16)
    assert not usage_plausible(800, chunks=None, recount=16)  # not streamed: the re-count only
    assert usage_plausible(30, chunks=None, recount=16)  # another tokenizer's count
    assert not usage_plausible(0, chunks=40, recount=None)  # 40 chunks carry >= 40 tokens


def _rec(i: float, ok: bool, tokens: int) -> ClientRecord:
    times = [i + 0.1 * k for k in range(1, tokens + 1)]
    return ClientRecord(
        request_id=f"r{i}",
        workload_class="c",
        intended_send=float(i),
        actual_send=float(i),
        output_tokens=tokens,
        chunk_times=times,
        chunk_tokens=[1] * tokens,
        done=times[-1],
        status=200,
        error=None if ok else "timeout: no complete response within 2s",
    )


def test_output_tokens_per_s_counts_successful_requests_only():
    recs = [_rec(0, True, 10), _rec(1, True, 10), _rec(2, False, 10)]
    m = summarize(recs, n_boot=50)
    th = m["overall"]["throughput"]
    window = m["window"]["end"] - m["window"]["start"]
    assert th["output_tokens_per_s"] == pytest.approx(20 / window)
    assert th["failed_output_tokens_per_s"] == pytest.approx(10 / window)
    console = Console(file=io.StringIO(), width=200)
    console.print(rates_table(m))
    assert "(+" in console.file.getvalue() and "failed)" in console.file.getvalue()


def test_the_progress_line_ends_before_the_next_output():
    console = Console(file=io.StringIO(), width=200)

    async def go():
        p = Progress(console, "stage", 3)
        p.start()
        await p.stop()

    asyncio.run(go())
    console.print("latency (measured window)")
    lines = console.file.getvalue().splitlines()
    assert lines[-1] == "latency (measured window)" and "TTFT p50" in lines[-2]


def test_time_windows_print_to_two_decimals():
    recs = [_rec(i * 1.00339, True, 3) for i in range(12)]  # the last send at 11.03729 s
    table = slices_table(summarize(recs, n_boot=50, slice_duration=4.0))
    console = Console(file=io.StringIO(), width=200)
    console.print(table)
    out = console.file.getvalue()
    assert "0-4 " in out and "8-11.04 " in out and "11.037" not in out


def test_a_closed_loop_wave_prints_no_rates_over_its_instant():
    recs = [_rec(0, True, 5) for _ in range(32)]
    for k, r in enumerate(recs):
        r.request_id = f"w{k}"
        r.actual_send = r.intended_send = 1e-5 * k  # the whole wave at once
    line = saturation_line(summarize(recs, n_boot=50))
    assert "req/s" not in line and "all 32 requests were sent within 0.01 s" in line


def test_a_bench_against_an_inflating_server_counts_what_streamed_and_warns(tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    with TestServer(Schedule(ttft=0.005, itl=0.001, usage_factor=50)).running() as u:
        p = subprocess.run(
            [sys.executable, "-m", "servelab.cli", "bench", "--url", u, "--requests", "4",
             "--concurrency", "2", "--out", str(out)],
            capture_output=True, text=True, timeout=120, check=False,
            env={**os.environ, "COLUMNS": "200"},
        )  # fmt: skip
    assert p.returncode in (0, 3), p.stdout + p.stderr  # 3: the client fell behind (busy cores)
    assert "the server's usage claimed output tokens its stream cannot have carried" in p.stdout
    m = json.loads((out / "metrics.json").read_text())
    recs = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert m["tokens"]["usage_disputed"] == len(recs) > 0
    streamed = sum(len(r["chunk_times"]) for r in recs)  # one word a chunk
    assert sum(r["output_tokens"] for r in recs) == streamed
    window = m["window"]["duration_s"]
    assert m["overall"]["throughput"]["output_tokens_per_s"] <= streamed / window * 1.001
