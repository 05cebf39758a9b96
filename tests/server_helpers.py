"""Helpers for the server tests: a server in a thread or as a child process, metrics
scraping, and the disconnect storm that several server test files run.

``serving()`` runs the server on ``server_fakes.fake_engine`` (no model weights); its core
imports that factory from this directory, so ``with_tests_on_pythonpath()`` puts the directory
on the children's PYTHONPATH.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from servelab.server.server_args import ServerArgs

TESTS_DIR = str(Path(__file__).parent)
HANG_UP_MAX_TOKENS = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """``servelab.server.main.serve`` on its own event loop in a thread; ``url`` once ready."""

    def __init__(self, args: ServerArgs, **serve_kwargs: Any) -> None:
        self.args = args
        self.kwargs = serve_kwargs
        self.url = ""
        self.exit_code: int | None = None
        self.client: Any = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import uvloop

        from servelab.server.main import serve

        async def main() -> int:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()

            def ready(port: int) -> None:
                self.url = f"http://127.0.0.1:{port}"
                self._ready.set()

            return await serve(self.args, stop=self._stop, on_ready=ready, **self.kwargs)

        try:
            self.exit_code = uvloop.run(main())
        finally:
            self._ready.set()

    def start(self, timeout: float = 120.0) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(timeout) or not self.url:
            raise RuntimeError(f"server did not start (exit code {self.exit_code})")
        return self

    def stop(self, timeout: float = 60.0) -> int | None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout)
        return self.exit_code


@contextlib.contextmanager
def with_tests_on_pythonpath() -> Iterator[None]:
    """This directory on PYTHONPATH while the block runs, so that child processes can import
    the engine factories of ``server_fakes``."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS_DIR, old) if p)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


@contextlib.contextmanager
def serving(model_dir: Path, **arg_overrides: Any) -> Iterator[ServerThread]:
    """A fake-engine server for the tiny model's tokenizer on a free loopback port."""
    args = ServerArgs(model=str(model_dir), port=0, served_model_name="tiny", **arg_overrides)
    server = ServerThread(args, engine_factory="server_fakes:fake_engine")
    with with_tests_on_pythonpath():
        try:
            yield server.start()
        finally:
            server.stop()


def newest_core_pid() -> int:
    """The engine core of the server started last. Servers run in threads of this process,
    so their cores are its children; /version shows no process ids."""
    cores = [
        p
        for p in psutil.Process().children()
        if "servelab.server.engine_core" in " ".join(p.cmdline())
    ]
    return max(cores, key=lambda p: p.create_time()).pid


@dataclass
class ServeProcess:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def serve_process(log: Path, *flags: str, startup_s: float = 240.0) -> Iterator[ServeProcess]:
    """Run `servelab serve` on a free loopback port until /health answers; always stop it."""
    port = free_port()
    cmd = [sys.executable, "-m", "servelab.cli", "serve", "--port", str(port), *flags]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    server = ServeProcess(proc, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + startup_s
        while True:
            assert proc.poll() is None, f"servelab serve exited early:\n{server.log_text()}"
            assert time.monotonic() < deadline, f"not ready in {startup_s} s:\n{server.log_text()}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def scrape(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{label=value,...}": value} (labels sorted; model/engine dropped)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            key = s.name + (
                "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
                if labels
                else ""
            )
            out[key] = s.value
    return out


def metrics(http: httpx.Client) -> dict[str, float]:
    return scrape(http.get("/metrics").text)


def wait_idle(http: httpx.Client, timeout: float = 30.0) -> dict[str, float]:
    """Metrics once the engine has no running or waiting request."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, "engine still busy"
        time.sleep(0.05)


def storm_leaves_no_trace(
    http: httpx.Client, n: int = 200, max_tokens: int = 12, seed: int = 7
) -> None:
    """``n`` concurrent streams, about a third hanging up mid-stream; then check that every
    KV block is free, the server is healthy, and counters and timelines agree."""
    rng = random.Random(seed)
    hang_up = [rng.random() < 0.35 for _ in range(n)]
    before = wait_idle(http)
    url = str(http.base_url).rstrip("/")

    async def one(session: aiohttp.ClientSession, i: int) -> tuple[str, int | None]:
        body = {
            "prompt": f"Request {i} says hello",
            # A hang-up asks for many tokens so that it usually outlives its client. It may
            # not: when the handler falls behind the engine, the server sends what is pending
            # as one event, and a loaded machine can deliver a whole stream in two events.
            "max_tokens": HANG_UP_MAX_TOKENS if hang_up[i] else max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            rid = resp.headers["X-Request-Id"]
            seen = 0
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                if b'"usage"' in line:
                    return rid, json.loads(line[6:])["usage"]["completion_tokens"]
                seen += 1
                if hang_up[i] and seen == 2:
                    resp.close()  # the client goes away mid-stream
                    return rid, None
        raise AssertionError("stream ended without usage")

    async def storm() -> list[tuple[str, int | None]]:
        auth = {k: v for k, v in http.headers.items() if k.lower() == "authorization"}
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, headers=auth) as session:
            return await asyncio.gather(*(one(session, i) for i in range(n)))

    results = asyncio.run(storm())
    after = wait_idle(http)
    assert after["servelab:kv_cache_blocks_used"] == 0 and after["vllm:kv_cache_usage_perc"] == 0
    assert http.get("/health").status_code == 200
    for (_, c), h in zip(results, hang_up, strict=True):
        assert c in ((None, HANG_UP_MAX_TOKENS) if h else (max_tokens,))
    closed = sum(c is None for _, c in results)
    # Every request ended exactly once, as length or abort, and its timeline says so.
    ends = {
        r: after[f"vllm:request_success_total{{finished_reason={r}}}"]
        - before.get(f"vllm:request_success_total{{finished_reason={r}}}", 0)
        for r in ("length", "abort")
    }
    # A closed stream whose last tokens were already on their way ends as length, not abort.
    assert ends["length"] + ends["abort"] == n and 0 < ends["abort"] <= closed
    ids = ",".join(r for r, _ in results)
    timelines = http.get("/v1/timelines", params={"ids": ids}).json()["timelines"]
    assert len(timelines) == n
    assert sum(t["finish_reason"] == "abort" for t in timelines) == ends["abort"]
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated == sum(t["output_tokens"] for t in timelines)
