"""Helpers for the server tests (no tests here): a server in a thread, and a model-free engine.

``fake_engine`` is the engine-core factory the API tests pass to ``serve``: the real
LLMEngine (scheduler, KV cache, detokenizer, timelines) and the real tokenizer of the
tiny model, over the engine tests' FakeExecutor instead of torch, with a small sleep per
step so that requests overlap as they do with a model. The core imports it from this
directory, so ``serving()`` puts it on the core's PYTHONPATH.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from servelab.server.args import ServerArgs

TESTS_DIR = str(Path(__file__).parent)
STEP_SLEEP_S = 0.003


def fake_engine(cfg: Any) -> Any:
    """Engine-core factory: real engine and tokenizer, fake executor (see the module doc)."""
    from engine_fakes import FakeExecutor

    from servelab.engine.config import EngineConfig
    from servelab.engine.engine import LLMEngine
    from servelab.model.tokenizer import Tokenizer

    class SleepyExecutor(FakeExecutor):
        def execute(self, plan: Any) -> Any:
            time.sleep(STEP_SLEEP_S)
            return super().execute(plan)

    tok = Tokenizer.from_model(cfg.model)
    executor = SleepyExecutor(
        vocab_size=tok.vocab_size, max_model_len=512, eos_token_ids=tok.eos_token_ids
    )
    return LLMEngine(executor, EngineConfig(**cfg.engine), tokenizer=tok)


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
def serving(model_dir: Path, **arg_overrides: Any) -> Iterator[ServerThread]:
    """A fake-engine server for the tiny model's tokenizer on a free loopback port."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS_DIR, old) if p)
    args = ServerArgs(model=str(model_dir), port=0, served_model_name="tiny", **arg_overrides)
    server = ServerThread(args, engine_factory="test_server_fakes:fake_engine")
    try:
        yield server.start()
    finally:
        server.stop()
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


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
