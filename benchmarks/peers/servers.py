"""OpenAI-compatible servers for the side-by-side benchmarks, each pinned to one CPU.

``PinnedServer`` starts a command under ``taskset`` with its output in a log file and waits
until ``/v1/models`` answers; the helpers below build the commands for vLLM's CPU server and
llama-cpp-python's server from the venvs of ``install.sh``, and for ``servelab serve``.
Every server binds to 127.0.0.1 and is stopped by ``stop`` (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

SERVED_NAME = "smollm2-135m"


def get(url: str, timeout: float = 2.0) -> bytes | None:
    """The body at ``url``, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read()
    except OSError:
        return None


class PinnedServer:
    def __init__(
        self, name: str, cmd: list[str], cpu: str, log: Path, port: int, env: dict[str, str]
    ) -> None:
        self.name, self.log = name, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            ["taskset", "-c", cpu, *cmd], stdout=log.open("w"), stderr=subprocess.STDOUT, env=env
        )

    def wait(self, timeout: float = 600.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: see {self.log}")
            if get(f"{self.url}/v1/models"):
                return
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} did not come up in {timeout:.0f} s: see {self.log}")

    def move_front(self, cpu: str) -> None:
        """Move the server's own process (every thread; for vLLM the API server) to ``cpu``,
        leaving the processes it started (vLLM's engine core) where they are."""
        for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
            os.sched_setaffinity(int(tid), {int(cpu)})

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _peer_env(threads: int) -> dict[str, str]:
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    env.pop("PYTHONPATH", None)  # a peer's venv must not see servelab's sources
    return env


def vllm(
    python: str, model_dir: Path, flags: list[str], log: Path, port: int, cpu: str, threads: int = 1
) -> PinnedServer:
    """vLLM's OpenAI server (CPU build) on exported HF weights, with per-request metrics."""
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
        "--enable-per-request-metrics", "--enforce-eager", *flags,
    ]  # fmt: skip
    env = _peer_env(threads) | {"VLLM_CPU_KVCACHE_SPACE": "1"}
    return PinnedServer("vLLM", cmd, cpu, log, port, env)


def llamacpp(
    python: str, gguf: Path, log: Path, port: int, cpu: str, threads: int = 1, n_ctx: int = 4096
) -> PinnedServer:
    """llama-cpp-python's OpenAI server on a GGUF as it ships (one request at a time)."""
    cmd = [
        python, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", SERVED_NAME,
        "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(n_ctx),
        "--n_threads", str(threads), "--n_threads_batch", str(threads),
    ]  # fmt: skip
    return PinnedServer("llama.cpp", cmd, cpu, log, port, _peer_env(threads))


def servelab(
    model: str, flags: list[str], log: Path, port: int, cpu: str, threads: int = 1
) -> PinnedServer:
    """``servelab serve`` from this interpreter (children inherit PYTHONPATH)."""
    cmd = [
        sys.executable, "-m", "servelab.cli", "serve", "--model", model, "--port", str(port),
        "--threads", str(threads), *flags,
    ]  # fmt: skip
    return PinnedServer("servelab", cmd, cpu, log, port, dict(os.environ))
