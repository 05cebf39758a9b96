"""`servelab serve --disaggregated`: the router and real worker processes on the tiny model,
over real HTTP, with real KV transfers between the workers.

Checks: output equal to colocated serving, the hand-off recorded in timelines and metrics,
the decode side's prefix cache after transfer, backpressure from a full decode pool, exact
block accounting after completion, aborts, failed transfers and killed workers.
The fault tests run the workers on ``server_fakes.faulty_engine``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from server_helpers import (
    ServerThread,
    metrics,
    storm_leaves_no_trace,
    wait_idle,
    with_tests_on_pythonpath,
)

from servelab.analyze.diagnosis.attribution import attribute
from servelab.engine.engine_config import EngineConfig
from servelab.engine.sampling_params import SamplingParams
from servelab.model import cpu_kernels, kernel_build
from servelab.model.build import build_engine
from servelab.model.llm import LLM
from servelab.modelcore.tokenizer import Tokenizer
from servelab.rundir import load_run
from servelab.server.server_args import ServerArgs

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "A paged KV cache stores keys and values in fixed-size blocks. " * 6,
    "Numbers like 12345 and 3.14159 are split into digits.",
]


@contextlib.contextmanager
def disagg_server(model_dir: Path, **overrides: Any) -> Iterator[ServerThread]:
    factory = overrides.pop("engine_factory", None)
    args = ServerArgs(
        model=str(model_dir),
        port=0,
        served_model_name="tiny",
        max_model_len=512,
        disaggregated=True,
        threads=1,
        **overrides,
    )
    server = ServerThread(args, engine_factory=factory)
    with with_tests_on_pythonpath():
        try:
            yield server.start(timeout=240)
        finally:
            server.stop()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> LLM:
    """Colocated serving's engine: the same model and config in this process."""
    return LLM.from_engine(
        build_engine(str(tiny_llama_dir), EngineConfig(max_model_len=512), device="cpu")
    )


@pytest.fixture(scope="module", params=["shm", "socket"])
def server(request: pytest.FixtureRequest, tiny_llama_dir: Path) -> Iterator[ServerThread]:
    with disagg_server(tiny_llama_dir, kv_transport=request.param) as srv:
        yield srv


def complete(http: httpx.Client, prompt: Any, max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json={**body, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def stream_lines(http: httpx.Client, body: dict[str, Any], **kw: Any) -> list[str]:
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}, **kw) as r:
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line]


def worker_blocks(http: httpx.Client) -> dict[str, float]:
    """Each worker's KV blocks in use, once the server is idle (parked and reserved requests
    count as running, so idle means no worker holds a block)."""
    wait_idle(http)
    return {
        k: v
        for k, v in metrics(http).items()
        if k.startswith("servelab:disagg_worker_kv_blocks_used")
    }


def kill(http: httpx.Client, name: str) -> None:
    (pid,) = [w["pid"] for w in http.get("/version").json()["workers"] if w["name"] == name]
    psutil.Process(pid).send_signal(signal.SIGKILL)


# ---- output and records ----


def test_greedy_output_equals_colocated(
    http: httpx.Client, tiny_tok: Tokenizer, reference: LLM
) -> None:
    ids = [tiny_tok.encode(p, add_special_tokens=True) for p in PROMPTS]
    expected = reference.generate(
        ids, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    )

    async def run() -> list[str]:
        body = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=str(http.base_url), timeout=60) as c:
            rs = await asyncio.gather(
                *(c.post("/v1/completions", json={**body, "prompt": p}) for p in PROMPTS)
            )
        return [r.json()["choices"][0]["text"] for r in rs]

    assert asyncio.run(run()) == [e.text for e in expected]  # concurrent, non-streaming
    lines = stream_lines(
        http, {"prompt": PROMPTS[2], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    )
    # The first token comes from the prefill worker and the rest from the decode worker, but a
    # handler that falls behind sends what is pending as one event: the count is not fixed.
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]"
    assert "".join(e["choices"][0]["text"] for e in events) == expected[2].text
    # Seeded sampling continues at the right output index on the decode side.
    sp = SamplingParams(max_tokens=12, temperature=0.8, seed=11, ignore_eos=True)
    seeded = complete(http, PROMPTS[1], 12, temperature=0.8, seed=11)
    assert seeded["choices"][0]["text"] == reference.generate([ids[1]], sp)[0].text


def test_timeline_and_metrics_record_the_transfer(http: httpx.Client) -> None:
    before = metrics(http)
    body = complete(http, PROMPTS[2], 6)
    transfer = body["servelab"]["kv_transfer"]
    assert transfer["bytes"] > 0 and transfer["blocks"] >= 1 and transfer["seconds"] > 0
    rid = body["servelab"]["request_id"]
    # The sender's own report travels on the prefill worker's channel and may land after a
    # short decode has answered; the stored timeline gets its start when it does.
    deadline = time.monotonic() + 5
    while True:
        (tl,) = http.get("/v1/timelines", params={"ids": rid}).json()["timelines"]
        kv = tl["kv_transfer"]
        if "start" in kv or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert kv["prefill_worker"] == 0 and kv["decode_worker"] == 1
    assert tl["first_token"] <= kv["start"] <= kv["end"] <= tl["token_times"][1]
    assert len(tl["token_times"]) == 6 and tl["finish_reason"] == "length"
    after = metrics(http)
    assert after["servelab:kv_transfer_bytes_total"] - before.get(
        "servelab:kv_transfer_bytes_total", 0
    ) == pytest.approx(transfer["bytes"])
    assert (
        after["servelab:kv_transfers_total{result=ok}"]
        - before.get("servelab:kv_transfers_total{result=ok}", 0)
        == 1
    )
    steps = http.get("/v1/timelines", params={"ids": ""}).json()["steps"]
    assert {s["role"] for s in steps} == {"prefill", "decode"}
    step_ids = [s["step_id"] for s in steps]
    assert step_ids == sorted(set(step_ids))  # one increasing sequence over all workers


def test_shared_prefix_hits_the_decode_cache_after_transfer(
    http: httpx.Client, tiny_tok: Tokenizer
) -> None:
    assert http.post("/reset_prefix_cache").json() == {"reset": True}
    system = tiny_tok.encode("Continuous batching mixes prefill chunks with decode steps. " * 8)
    first = complete(http, system + tiny_tok.encode(" First question?"), 4)["servelab"]
    second = complete(http, system + tiny_tok.encode(" Second one!"), 4)["servelab"]
    assert first["kv_transfer"]["skipped_blocks"] == 0
    # Every full block of the shared prefix was already on the decode worker: not sent again.
    assert second["kv_transfer"]["skipped_blocks"] == len(system) // 16
    assert second["kv_transfer"]["blocks"] < first["kv_transfer"]["blocks"]
    assert second["cached_prompt_tokens"] >= (len(system) // 16) * 16  # and on the prefill side


def test_a_bench_run_attributes_each_request_to_its_own_workers(
    server: ServerThread, tmp_path: Path
) -> None:
    # The prefill and decode workers step at the same times; a request's TTFT parts come
    # from its prefill worker's steps only, and add up to its TTFT.
    out = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, "-m", "servelab.cli", "bench", "--url", server.url]
        + ["--workload", "chat", "--requests", "8", "--concurrency", "4", "--out", str(out)]
        + ["--quiet", "--length-scale", "0.2"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert p.returncode in (0, 3), p.stderr + p.stdout  # 3: the client lagged on a busy machine
    run = load_run(out)
    assert {s.role for s in run.steps} == {"prefill", "decode"}
    tls = [run.timeline_for(r) for r in run.records]
    assert all(t is not None and t.role == "prefill" and t.decode_replica is not None for t in tls)
    exact = [b for b in attribute(run).ttft if b.source == "exact"]
    summary = [(r.request_id, r.status, r.error, len(r.chunk_times)) for r in run.records]
    assert len(exact) == len(run.records), summary
    for b in exact:
        assert sum(b.parts().values()) == pytest.approx(b.ttft + b.client_lag, abs=1e-6)
        assert b.interference <= b.ttft


def test_health_and_version_list_the_workers(http: httpx.Client) -> None:
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    workers = http.get("/version").json()["workers"]
    assert [(w["name"], w["role"], w["alive"]) for w in workers] == [
        ("prefill-0", "prefill", True),
        ("decode-0", "decode", True),
    ]
    assert all(psutil.Process(w["pid"]).is_running() and w["torch_threads"] == 1 for w in workers)
    # Each worker's model runs on the kernels' build this CPU takes (q4_1's numerics follow it).
    built = kernel_build.isa() if cpu_kernels.available() else ""
    assert [w["cpu_kernels"] for w in workers] == [built, built]


def test_client_disconnect_frees_blocks_on_every_worker(http: httpx.Client) -> None:
    body = {"prompt": "Hello", "max_tokens": 450, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": "gone"}) as r:
        lines = r.iter_lines()
        next(lines)
        next(lines)
    assert set(worker_blocks(http).values()) == {0}
    (tl,) = http.get("/v1/timelines", params={"ids": "gone"}).json()["timelines"]
    assert tl["finish_reason"] == "abort" and 0 < tl["output_tokens"] < 450


def test_storm_with_random_disconnects_leaves_every_block_free(http: httpx.Client) -> None:
    storm_leaves_no_trace(http, n=120)
    assert set(worker_blocks(http).values()) == {0}


# ---- backpressure, faults (own servers) ----


def test_full_decode_pool_makes_prefill_wait_and_drops_nothing(
    tiny_llama_dir: Path, tiny_tok: Tokenizer, reference: LLM
) -> None:
    # 40 blocks of 16 tokens: one 330-token request (21 blocks, 24 with its output) at a time.
    prompts = [
        tiny_tok.encode(
            f"Request {i}: " + "Paged attention reads blocks of keys and values. " * 40
        )[:330]
        for i in range(5)
    ]
    with (
        disagg_server(tiny_llama_dir, num_gpu_blocks_override=40) as srv,
        httpx.Client(base_url=srv.url, timeout=120) as http,
    ):

        async def run() -> list[dict[str, Any]]:
            body = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                rs = await asyncio.gather(
                    *(c.post("/v1/completions", json={**body, "prompt": p}) for p in prompts)
                )
            assert [r.status_code for r in rs] == [200] * len(prompts)
            return [r.json() for r in rs]

        bodies = asyncio.run(run())
        sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        assert [b["choices"][0]["text"] for b in bodies] == [
            r.text for r in reference.generate(prompts, sp)
        ]
        waits = [b["servelab"]["queue_time"] for b in bodies]
        decode = [b["servelab"]["decode_time"] for b in bodies]
        # Held before prefill until another request's decode freed the decode pool.
        assert max(waits) > min(decode) / 2
        assert not any(k.startswith("servelab:kv_transfer_failures") for k in metrics(http))
        assert set(worker_blocks(http).values()) == {0}


def test_failed_and_lost_transfers_fail_cleanly(tiny_llama_dir: Path) -> None:
    with (
        disagg_server(
            tiny_llama_dir,
            engine_factory="server_fakes:faulty_engine",
            kv_transfer_timeout=1.5,
        ) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as http,
    ):
        body = {"prompt": PROMPTS[0], "max_tokens": 8, "ignore_eos": True}
        cases = (
            ("fail-send-1", "send", "KV transfer failed (send) on prefill-0"),
            ("lose-1", "timeout", "timed out in the transfer stage"),
        )
        for rid, reason, says in cases:
            lines = stream_lines(http, body, headers={"X-Request-Id": rid})
            assert lines[-1] == "data: [DONE]"
            first, error = json.loads(lines[0][6:]), json.loads(lines[-2][6:])["error"]
            assert first["choices"][0]["finish_reason"] is None  # the first token came out
            assert says in error["message"] and error["type"] == "server_error"
            r = http.post("/v1/completions", json=body, headers={"X-Request-Id": rid + "-b"})
            assert r.status_code == 503 and says in r.json()["error"]["message"]
            m = metrics(http)
            assert m[f"servelab:kv_transfer_failures_total{{reason={reason}}}"] == 2
        tls = http.get("/v1/timelines", params={"ids": "fail-send-1,lose-1"}).json()["timelines"]
        assert [t["finish_reason"] for t in tls] == ["error", "error"]
        assert all(t["error"] and t["output_tokens"] == 1 for t in tls)
        assert set(worker_blocks(http).values()) == {0}
        assert complete(http, PROMPTS[0], 8)["usage"]["completion_tokens"] == 8


def test_killed_workers_fail_their_requests_and_the_rest_keep_serving(
    tiny_llama_dir: Path,
) -> None:
    with (
        disagg_server(
            tiny_llama_dir,
            engine_factory="server_fakes:faulty_engine",
            prefill_workers=2,
            decode_workers=2,
        ) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as http,
    ):
        long = {"prompt": PROMPTS[1], "max_tokens": 300, "ignore_eos": True, "stream": True}

        async def stream(c: httpx.AsyncClient, rid: str, first: asyncio.Event) -> list[str]:
            lines = []
            async with c.stream(
                "POST", "/v1/completions", json=long, headers={"X-Request-Id": rid}
            ) as r:
                async for line in r.aiter_lines():
                    if line:
                        lines.append(line)
                        if len(lines) == 2:
                            first.set()
            return lines

        async def decode_kill() -> list[list[str]]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                started = [asyncio.Event() for _ in range(4)]
                tasks = [asyncio.create_task(stream(c, f"d{i}", started[i])) for i in range(4)]
                for e in started:
                    await asyncio.wait_for(e.wait(), 30)
                kill(http, "decode-0")
                return await asyncio.gather(*tasks)

        results = asyncio.run(decode_kill())
        failed = [ls for ls in results if "engine_dead" in ls[-2]]
        done = [ls for ls in results if '"finish_reason":"length"' in ls[-2]]
        assert failed and done and len(failed) + len(done) == 4  # both decode workers had some
        assert all("decode-0 worker" in ls[-2] and "exited unexpectedly" in ls[-2] for ls in failed)
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        dead = [w for w in health.json()["workers"] if not w["alive"]]
        assert [w["name"] for w in dead] == ["decode-0"] and "exit code" in dead[0]["error"]
        assert complete(http, PROMPTS[0], 5)["usage"]["completion_tokens"] == 5

        async def prefill_kill() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                body = {"prompt": PROMPTS[0], "max_tokens": 4}
                slow = asyncio.create_task(
                    c.post("/v1/completions", json=body, headers={"X-Request-Id": "slow-1"})
                )
                while not metrics(http).get("servelab:disagg_requests{stage=prefill}"):
                    await asyncio.sleep(0.02)  # routed to prefill-0 (the first of the idle)
                kill(http, "prefill-0")
                other = await c.post("/v1/completions", json=body)
                return [await slow, other]

        slow, other = asyncio.run(prefill_kill())
        assert slow.status_code == 503 and "prefill-0 worker" in slow.json()["error"]["message"]
        assert other.status_code == 200  # routed to prefill-1
        assert http.get("/health").json()["status"] == "degraded"
        blocks = worker_blocks(http)
        assert blocks and set(blocks.values()) == {0}  # the survivors hold nothing
