"""The server under test: launch the embedded one, or probe a given URL.

``LaunchedServer`` starts ``servelab serve`` as a child process on a free loopback port,
printing its command first, waits for ``/health`` (with a spinner), and ``stop()`` ends it
(SIGTERM, then SIGKILL); it dies with this process however that ends (``lifetime``).
``Launched`` is what it shares with a server launched from a template (``template``).
``probe`` reads what a server says about itself: ``/version``, ``/v1/models``, the
``*_info`` gauges of ``/metrics`` (vLLM's ``vllm:cache_config_info``: block size, KV
blocks, prefix caching...) and whether it serves servelab timelines.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from servelab.analyze.server_side.promscrape import info_metrics
from servelab.bench.manifest import redact, redact_args
from servelab.bench.servers import lifetime
from servelab.engine_flags import read_flags

HEALTH_TIMEOUT_S = 900.0  # loading and dequantising a model on 2 cores takes a while


@dataclass
class ServerInfo:
    """What a target told us about itself."""

    url: str
    version: dict[str, Any] | None = None
    models: list[dict[str, Any]] = field(default_factory=list)
    timelines: bool = False  # serves /v1/timelines (a servelab server)
    launched: bool = False
    command: list[str] | None = None
    engine_args: str = ""
    info_metrics: dict[str, dict[str, str]] = field(default_factory=dict)
    stated_command: list[str] | None = None  # bench --server-config, redacted

    @property
    def model_id(self) -> str | None:
        return self.models[0].get("id") if self.models else None

    @property
    def max_model_len(self) -> int | None:
        for m in self.models:
            v = m.get("max_model_len")
            if isinstance(v, int):
                return v
        return None

    @property
    def kind(self) -> str:
        return "servelab" if self.timelines else "other"

    @property
    def engine_config(self) -> dict[str, Any] | None:
        """The engine config the server resolved at start-up, where it reports one (a
        servelab server's ``/version``); None for servers that do not."""
        engine = (self.version or {}).get("engine")
        config = engine.get("engine_config") if isinstance(engine, dict) else None
        return config if isinstance(config, dict) else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "kind": self.kind,
            "launched": self.launched,
            "command": self.command,
            "engine_args": self.engine_args,
            "config": read_flags(self.engine_args),
            "engine_config": self.engine_config,
            "version": self.version,
            "models": self.models,
            "model": self.model_id,
            "max_model_len": self.max_model_len,
            "info_metrics": self.info_metrics,
            **({"stated_command": self.stated_command} if self.stated_command else {}),
        }


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def probe(url: str, api_key: str | None = None, timeout: float = 10.0) -> ServerInfo:
    """Ask the target about itself; raises ValueError when it does not answer at all."""
    info = ServerInfo(url=url)
    to = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(timeout=to, headers=_auth(api_key)) as s:
        try:
            async with s.get(f"{url}/v1/models") as r:
                if r.status == 401:
                    raise ValueError(
                        f"{url} refused the API key (401): pass --api-key or set OPENAI_API_KEY"
                    )
                if r.status == 200:
                    info.models = (await r.json()).get("data", []) or []
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise ValueError(
                f"cannot reach {url}: {e}; check --url and that the server is up"
            ) from None
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            async with s.get(f"{url}/version") as r:
                if r.status == 200:
                    info.version = await r.json(content_type=None)
        # A /metrics that is missing or not Prometheus text leaves the description empty;
        # the scraper notes it once for the run.
        with contextlib.suppress(
            aiohttp.ClientError, asyncio.TimeoutError, ValueError, TypeError, IndexError
        ):
            async with s.get(f"{url}/metrics") as r:
                if r.status == 200:
                    info.info_metrics = info_metrics(await r.text())
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            async with s.get(f"{url}/v1/timelines", params={"ids": ""}) as r:
                body = await r.json(content_type=None) if r.status == 200 else None
                info.timelines = isinstance(body, dict) and "timelines" in body
    return info


async def reset_prefix_cache(url: str, api_key: str | None = None) -> tuple[bool, str]:
    """``POST /reset_prefix_cache``; returns (flushed, what happened) and never raises."""
    try:
        async with (
            aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=30), headers=_auth(api_key)
            ) as s,
            s.post(f"{url}/reset_prefix_cache") as r,
        ):
            if r.status == 200:
                body = await r.json(content_type=None)
                ok = not isinstance(body, dict) or body.get("reset", True) is not False
                return ok, "flushed" if ok else f"the server declined: {body}"
            return False, f"the server does not allow it (HTTP {r.status})"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        return False, f"could not ask: {e}"


def log_tail(path: Path, n: int = 25) -> str:
    """The last ``n`` lines of a launched server's log ("" when it cannot be read)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# Several launched servers can be up at once (a matrix); the client's own affinity is
# restored when the last of them stops.
_pins = 0
_client_affinity: set[int] | None = None


def launch_cpus() -> set[int]:
    """The CPUs this process had before a launched server pinned it to the client's: what
    a server started now may use (a child inherits the pinned set otherwise)."""
    if _pins and _client_affinity:
        return set(_client_affinity)
    return os.sched_getaffinity(0)


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """Within it, processes this thread starts get ``launch_cpus`` rather than the client's
    pinned CPU (affinity is per thread and a child inherits its parent thread's)."""
    cpus, now = launch_cpus(), os.sched_getaffinity(0)
    if cpus != now:
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        if cpus != now:
            os.sched_setaffinity(0, now)


def split_cpus() -> tuple[set[int], set[int]] | None:
    """(client CPUs, server CPUs) when there are at least two CPUs to split, else None.

    The client keeps the first CPU and the server gets the rest: on a 2-core machine a
    client and a server that share both cores distort each other's timings. The split is
    of ``launch_cpus``, so a second server started while the first is up is pinned beside
    it, not onto the client's CPU.
    """
    cpus = sorted(launch_cpus())
    if len(cpus) < 2 or shutil.which("taskset") is None:
        return None
    return {cpus[0]}, set(cpus[1:])


def _pin_client(cpus: set[int]) -> None:
    global _pins, _client_affinity
    if _pins == 0:
        _client_affinity = os.sched_getaffinity(0)
    _pins += 1
    os.sched_setaffinity(0, cpus)


def _unpin_client() -> None:
    global _pins
    _pins -= 1
    if _pins == 0 and _client_affinity:
        os.sched_setaffinity(0, _client_affinity)


def announce_to_stderr(line: str) -> None:
    """The default ``announce`` of a launched server: the lines it says before it starts
    (``launching: COMMAND``, and a ``warning:`` for each stale server)."""
    print(line, file=sys.stderr, flush=True)


class Launched:
    """What a launched server has whatever launched it: its process (started through
    ``lifetime.launch_argv`` and registered there, so it dies with this process), ``url``,
    the redacted ``command``, its log, and the one health wait.

    A subclass sets ``name`` (for messages) and ``health_paths`` (any one answering 200
    means healthy), and its ``stop()`` ends the process and calls ``lifetime.unregister``.
    """

    name = "the server"
    health_paths: tuple[str, ...] = ("/health",)
    proc: subprocess.Popen[bytes]
    url: str
    command: list[str]
    log_path: Path

    def _launch(
        self, argv: list[str], announce: Callable[[str], None], **popen: Any
    ) -> subprocess.Popen[bytes]:
        """Warn of servers an earlier crash left running, print the (redacted) command,
        then start ``argv`` in a session of its own."""
        for line in lifetime.stale(new_only=True):
            announce(f"warning: {line}")
        announce(f"launching: {shlex.join(self.command)}")
        proc = subprocess.Popen(lifetime.launch_argv(argv), start_new_session=True, **popen)
        self.proc = proc
        lifetime.register(self)
        return proc

    def stop(self, grace: float = lifetime.GRACE_S) -> int | None:
        raise NotImplementedError

    def log_tail(self, n: int = 25) -> str:
        return log_tail(self.log_path, n)

    async def wait_healthy(self, timeout: float = HEALTH_TIMEOUT_S, status: Any = None) -> None:
        """Poll ``health_paths`` until one answers 200. RuntimeError, with the log's tail,
        when the process exits first or is not healthy within ``timeout`` seconds; the
        server is stopped before it is raised."""
        t0 = time.monotonic()
        cmd = shlex.join(self.command)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
            while True:
                if self.proc.poll() is not None:
                    code = self.proc.returncode
                    self.stop()
                    raise RuntimeError(
                        f"{self.name} `{cmd}` exited with code {code} before it was ready. "
                        f"Its log ({self.log_path}) ends with:\n{self.log_tail()}"
                    )
                for path in self.health_paths:
                    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                        async with s.get(f"{self.url}{path}") as r:
                            if r.status == 200:
                                return
                waited = time.monotonic() - t0
                if waited > timeout:
                    self.stop()
                    raise RuntimeError(
                        f"{self.name} `{cmd}` was not healthy on {self.url} after "
                        f"{timeout:.0f} s (no 200 from {' or '.join(self.health_paths)}); "
                        f"stopped it. Its log ({self.log_path}) ends with:\n{self.log_tail()}"
                    )
                if status is not None:
                    status.update(f"starting {self.name} on {self.url} ... {waited:.0f}s")
                await asyncio.sleep(0.25)


class LaunchedServer(Launched):
    """A ``servelab serve`` child process on a loopback port.

    With ``pin`` (the default) and two or more CPUs, the server runs under ``taskset`` on
    all CPUs but the first, and this process is moved to the first until ``stop()``
    restores its affinity; the recorded command shows the pinning.
    """

    name = "`servelab serve`"

    def __init__(
        self,
        model: str,
        engine_args: str,
        log_path: Path,
        api_key: str | None = None,
        pin: bool = True,
        announce: Callable[[str], None] = announce_to_stderr,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine_args = redact_args(engine_args)  # recorded in manifests
        extra = shlex.split(engine_args or "")
        for flag in ("--port", "--host", "--model"):
            if any(a == flag or a.startswith(flag + "=") for a in extra):
                raise ValueError(
                    f"--engine-args must not set {flag}: the benchmark picks it "
                    "(use --model for the model; give --url to test a server you started)"
                )
        split = split_cpus() if pin else None
        self._pinned = split is not None
        pin_prefix = ["taskset", "-c", ",".join(map(str, sorted(split[1])))] if split else []
        argv = [
            *pin_prefix,
            sys.executable,
            "-m",
            "servelab.cli",
            "serve",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *extra,
        ]
        self.command = redact(argv)  # recorded in manifests
        self.log_path = log_path
        env = dict(os.environ)
        if api_key:
            env["SERVELAB_API_KEY"] = api_key
        self._log = open(log_path, "ab")  # noqa: SIM115 -- closed in stop()
        self._log.write(f"$ {shlex.join(self.command)}\n".encode())
        self._log.flush()
        self._launch(argv, announce, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        if split:
            _pin_client(split[0])

    def stop(self, grace: float = lifetime.GRACE_S) -> int | None:
        """SIGTERM, wait ``grace`` seconds, then SIGKILL. Returns the exit code."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        lifetime.unregister(self)
        if self._pinned:
            _unpin_client()
            self._pinned = False
        self._log.close()
        return self.proc.returncode
