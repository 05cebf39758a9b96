"""Another server (vLLM, SGLang, llama-server, any OpenAI server) launched from a command template.

A template is a shell-like command line with placeholders: ``{model}``, ``{port}`` (required:
the server must listen where the benchmark looks), ``{host}`` (127.0.0.1) and ``{flags}`` (the
configuration's own flags, in that server's spelling), e.g.::

    taskset -c 1 vllm serve {model} --host {host} --port {port} {flags}
    VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server --model {model} --port {port} {flags}

A template must say where its server listens: ``{host}`` (loopback), or a ``--host`` of the
user's own; one that says neither is refused. Leading ``NAME=value`` words set the server's
environment, as in a shell. The command is printed before it runs (``announce``). The server
gets a session and process group of its own (``start_new_session``), so ``stop()`` ends it
and every process it started (vLLM's engine core) with SIGTERM to the group, then SIGKILL to
whatever is left after the grace period; it dies with this process however that ends
(``lifetime``). Its output goes to a log file through a pump that replaces every
secret of the command (``bench.manifest.secrets_in``: API keys, tokens, an Authorization
header, secret-named variables) by ``***``; ``command`` is the redacted command, for manifests.

``wait_healthy`` (``target.Launched``'s, shared with `servelab serve`) polls ``/health`` and
``/v1/models`` until either answers 200, and fails with the log's tail when the process exits
first or the timeout passes (stopping the group).
:class:`TemplateServer` has :class:`~servelab.bench.servers.target.LaunchedServer`'s interface, so a
matrix (``workflows.matrix``) runs configurations of another server as it runs its own.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from servelab.analyze.server_side.serversettings import kind_of_command, parse_flags
from servelab.bench.manifest import hide_secrets, redact, redact_args, secrets_in
from servelab.bench.servers import lifetime
from servelab.bench.servers.lifetime import GRACE_S, group_members
from servelab.bench.servers.target import Launched, announce_to_stderr, free_port, unpinned

HEALTH_TIMEOUT_S = 900.0
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PLACEHOLDERS = ("{model}", "{port}", "{host}", "{flags}")
# Secrets shorter than this are not searched for in the log (every "1" would go).
MIN_SECRET_LEN = 4


def render(
    template: str, model: str, port: int, flags: str = "", host: str = "127.0.0.1"
) -> list[str]:
    """The template as an argument list, placeholders filled. ValueError when it has no
    ``{port}``, an unknown ``{placeholder}`` or unbalanced quotes, or says nowhere where the
    server listens: without ``{host}`` (loopback) or a ``--host`` of its own, a server may
    listen on every interface."""
    if "{port}" not in template:
        raise ValueError(
            f"the server template {template!r} has no {{port}}: write it where the server "
            "takes its port, e.g. 'vllm serve {model} --host {host} --port {port} {flags}'"
        )
    if "{host}" not in template and not re.search(r"(^|\s)--host[\s=]", template):
        raise ValueError(
            f"the server template {template!r} has no {{host}}: without it a server may "
            "listen on every interface; write --host {host} (loopback), or an address of "
            "your own with --host ADDRESS"
        )
    unknown = sorted(set(re.findall(r"\{[a-z_]+\}", template)) - set(PLACEHOLDERS))
    if unknown:
        raise ValueError(
            f"the server template has unknown placeholder(s) {', '.join(unknown)}; use "
            + ", ".join(PLACEHOLDERS)
        )
    text = (
        template.replace("{model}", shlex.quote(model))
        .replace("{port}", str(port))
        .replace("{host}", host)
        .replace("{flags}", flags)
    )
    try:
        argv = shlex.split(text)
    except ValueError as e:
        raise ValueError(f"the server template does not parse as a command line: {e}") from None
    if not [a for a in argv if not _ENV.match(a)]:
        raise ValueError("the server template names no program to run")
    return argv


def _split_env(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    env: dict[str, str] = {}
    i = 0
    while i < len(argv) and _ENV.match(argv[i]):
        name, _, value = argv[i].partition("=")
        env[name] = value
        i += 1
    return env, argv[i:]


def _pump(src: IO[bytes], dst: IO[bytes], secrets: list[bytes]) -> None:
    """Copy the server's output to its log, line by line, with its secrets hidden."""
    for line in iter(src.readline, b""):
        for s in secrets:
            line = line.replace(s, b"***")
        dst.write(line)
        dst.flush()
    src.close()


class TemplateServer(Launched):
    """A server started from a template on a free loopback port (see the module doc).

    ``flags`` fill ``{flags}`` and are this configuration's ``engine_args``; ``config`` is
    what the whole command sets, in engine-config names (``analyze.server_side.serversettings``);
    ``command``, ``template`` and ``engine_args`` are redacted."""

    health_paths = ("/health", "/v1/models")

    def __init__(
        self,
        template: str,
        log_path: Path,
        model: str = "",
        flags: str = "",
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        announce: Callable[[str], None] = announce_to_stderr,
    ) -> None:
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.engine_args = redact_args(flags)  # recorded in manifests
        argv = render(template, model, self.port, flags, host)
        extra_env, program = _split_env(argv)
        self.command = redact(argv)
        # the template with the rendered command's secrets hidden (for manifests)
        self.template = hide_secrets(template, secrets_in(argv))
        kind = kind_of_command(program)
        self.config: dict[str, Any] = parse_flags(kind, program) if kind else {}
        self.log_path = log_path
        full_env = {**os.environ, **(env or {}), **extra_env}
        secrets = secrets_in(argv) + [
            v for k, v in {**(env or {}), **extra_env}.items() if secrets_in([f"{k}={v}"])
        ]
        self._secrets = [s.encode() for s in secrets if len(s) >= MIN_SECRET_LEN]
        self._log = open(log_path, "ab")  # noqa: SIM115 -- closed in stop()
        self._log.write(f"$ {shlex.join(self.command)}\n".encode())
        self._log.flush()
        if shutil.which(program[0], path=full_env.get("PATH")) is None:
            self._log.close()
            raise RuntimeError(
                f"cannot start the server `{shlex.join(self.command)}`: no program "
                f"{hide_secrets(program[0], secrets)!r} (not a file nor on PATH)"
            )
        with unpinned():  # not on the client's CPU when a launched server pinned it
            self._launch(
                program,
                announce,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
            )
        assert self.proc.stdout is not None
        self._thread = threading.Thread(
            target=_pump, args=(self.proc.stdout, self._log, self._secrets), daemon=True
        )
        self._thread.start()

    def stop(self, grace: float = GRACE_S) -> int | None:
        """SIGTERM to the server's process group, SIGKILL to what is left after ``grace``
        seconds; returns the server's exit code. Safe to call twice."""
        pgid = self.proc.pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (self.proc.poll() is None or group_members(pgid)):
            time.sleep(0.05)
        if self.proc.poll() is None or group_members(pgid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            self.proc.wait()
            end = time.monotonic() + 5.0
            while group_members(pgid) and time.monotonic() < end:
                time.sleep(0.05)
        lifetime.unregister(self)
        self._thread.join(5.0)
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode
