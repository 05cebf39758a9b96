"""bench.servers.lifetime: launched servers die with the process that launched them, on
SIGTERM, SIGHUP and SIGKILL of it, with every process of their group; a server an earlier
crash left running is found and reported, not killed.

The launcher is a real Python process starting servers the way `tune --verify` and
`bench --matrix` do (``workflows.matrix.start_servers``); the servers are the bench's
stand-in (``servelab.testing.testserver``), each with a child of its own (as vLLM starts
its engine core), all on loopback.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import psutil
import pytest

from servelab.bench.servers import lifetime

# A server that starts a child process of its own, then serves.
SERVER = (
    "import runpy, subprocess, sys; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
    "sys.argv = ['testserver', *sys.argv[1:]]; "
    "runpy.run_module('servelab.testing.testserver', run_name='__main__')"
)
LAUNCHER = """
import json, shlex, sys, time
from pathlib import Path
from rich.console import Console
from servelab.workflows.matrix import start_servers

tpl = f"{shlex.quote(sys.executable)} -c {shlex.quote(sys.argv[2])} --host {{host}} --port {{port}}"
servers = start_servers({"a": "", "b": ""}, Path(sys.argv[1]), "m",
                        console=Console(stderr=True), templates={"a": tpl, "b": tpl},
                        health_timeout=60)
print(json.dumps([s.proc.pid for s in servers.values()]), flush=True)
time.sleep(300)
"""


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _default_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _everything_gone(groups: list[int], within: float) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if not any(lifetime.group_members(g) for g in groups):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL], ids=lambda s: s.name
)
def test_servers_die_with_their_launcher(tmp_path, sig):
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "state")}
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path), SERVER],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        # as from a terminal: under `nohup` (a CI runner's shell, say) SIGHUP is inherited
        # ignored, and the launcher rightly keeps an ignored signal ignored
        preexec_fn=_default_signals,
    )
    groups: list[int] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # once both servers are healthy
        assert line, proc.stderr.read().decode() if proc.stderr else ""
        groups = json.loads(line)
        members = [m for g in groups for m in lifetime.group_members(g)]
        assert len(members) == 4  # two servers, each with its child
        said = proc.stderr.read1().decode() if proc.stderr else ""  # type: ignore[attr-defined]
        assert said.count("launching: ") == 2 and "--host 127.0.0.1" in said
        assert len(list((tmp_path / "state" / "servelab" / "servers").glob("*.json"))) == 2
        proc.send_signal(sig)
        proc.wait(timeout=60)
        assert proc.returncode == -sig  # it died of the signal, as it would have
        assert _everything_gone(groups, within=40), _alive(members)
        if sig != signal.SIGKILL:  # a handler that ran cleaned its records up
            assert not list((tmp_path / "state" / "servelab" / "servers").glob("*.json"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for g in groups:
            lifetime.end_groups([g], grace=0.5)


def test_a_server_an_earlier_crash_left_running_is_reported_not_killed(tmp_path, monkeypatch):
    from servelab.bench.servers.template import TemplateServer

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    state = lifetime.state_dir()
    state.mkdir(parents=True)
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        started = psutil.Process(orphan.pid).create_time()
        dead_launcher = {"launcher": gone.pid, "launcher_started": 1.0}
        (state / f"{orphan.pid}.json").write_text(
            json.dumps(
                {"pid": orphan.pid, "started": started, "url": "http://127.0.0.1:1",
                 "command": ["vllm", "serve", "m"], **dead_launcher}
            )
        )  # fmt: skip
        (state / "999999.json").write_text(
            json.dumps({"pid": 999999, "started": 2.0, "url": "u", **dead_launcher})
        )
        # a server whose launcher still runs is someone's live server, not stale
        mine = {"launcher": os.getpid(), "launcher_started": psutil.Process().create_time()}
        (state / "1.json").write_text(json.dumps({"pid": 1, "started": 0.0, **mine}))
        # the next launch warns of it first, once
        said: list[str] = []
        tpl = f"{sys.executable} -c 'import time; time.sleep(60)' --host {{host}} --port {{port}}"
        for name in ("a", "b"):
            TemplateServer(tpl, tmp_path / f"{name}.log", announce=said.append).stop(grace=1.0)
        warnings = [s for s in said if s.startswith("warning: ")]
        assert len(warnings) == 1 and f"pid {orphan.pid}" in warnings[0]
        (line,) = lifetime.stale()
        assert f"pid {orphan.pid}" in line and "vllm serve m" in line
        assert f"kill -TERM -{orphan.pid}" in line
        assert orphan.poll() is None  # reported, not killed
        assert not (state / "999999.json").exists()  # a server that is gone is forgotten
        assert (state / "1.json").exists()
    finally:
        orphan.kill()
        orphan.wait()


def test_a_launch_is_printed_before_it_runs_and_recorded_until_it_stops(tmp_path, monkeypatch):
    from servelab.bench.servers.template import TemplateServer

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    said: list[str] = []
    srv = TemplateServer(
        f"{sys.executable} -c 'import time; time.sleep(60)' --host {{host}} --port {{port}}",
        tmp_path / "s.log",
        announce=said.append,
    )
    try:
        assert said == [f"launching: {shlex.join(srv.command)}"]
        assert [p.name for p in lifetime.state_dir().glob("*.json")] == [f"{srv.proc.pid}.json"]
    finally:
        srv.stop(grace=1.0)
    assert not list(lifetime.state_dir().glob("*.json"))
    assert _alive([srv.proc.pid]) == []
