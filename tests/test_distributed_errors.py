"""`servelab bench --workers/--ray-address`: bad flags, Ray missing, a cluster nobody answers
at, and Ctrl-C -- each says what happened and what to do."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from servelab.cli import app
from servelab.rundir import read_records
from servelab.testing.testserver import Schedule, run_test_server


@pytest.fixture(scope="module")
def server():
    with run_test_server(Schedule(ttft=0.02, itl=0.004)) as url:
        yield url


def _fails_with(args: list[str], message: str, tmp_path) -> None:
    r = CliRunner().invoke(
        app, ["bench", "--out", str(tmp_path / "x"), "--quiet", "--requests", "2", *args]
    )
    text = r.output + (r.stderr if r.stderr_bytes is not None else "")
    assert r.exit_code == 2, text
    assert message in " ".join(text.replace("│", " ").split()), text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "0"], "give 1 or more"),
        (["--workers", "2", "--ray-address", "head node"], "ray://HOST:10001"),
    ],
)
def test_bad_worker_flags_say_what_to_do(args, message, tmp_path):
    _fails_with(args, message, tmp_path)


def test_ray_not_installed_says_what_to_install(server, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if absent
    _fails_with(
        ["--url", server, "--workers", "2", "--ray-address", "auto"],
        "pip install 'servelab[ray]'",
        tmp_path,
    )


def test_an_unreachable_cluster_says_what_to_check(server, tmp_path):
    pytest.importorskip("ray")
    t = time.monotonic()
    _fails_with(
        ["--url", server, "--workers", "2", "--ray-address", "127.0.0.1:1"],
        "cannot reach the Ray cluster at 127.0.0.1:1",
        tmp_path,
    )
    assert time.monotonic() - t < 60  # not Ray's own minutes of retrying


def test_ctrl_c_stops_the_workers_and_keeps_what_they_recorded(server, tmp_path):
    out = tmp_path / "run"
    spec = tmp_path / "long.yaml"  # single turns streaming ~1.6 s each: always some in flight
    spec.write_text("name: long\nclasses:\n  - {name: long, input: 16, output: 400}\n")
    cmd = [sys.executable, "-m", "servelab.cli", "bench", "--url", server, "--quiet"]
    cmd += ["--workers", "2", "--concurrency", "4", "--duration", "60", "--out", str(out)]
    cmd += ["--workload", str(spec)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        jsonl = out / "requests.jsonl"
        while time.monotonic() < deadline and not (jsonl.exists() and jsonl.stat().st_size):
            time.sleep(0.2)
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGINT)  # the driver only: it stops its workers itself
        assert proc.wait(60) == 130, proc.stdout.read().decode() if proc.stdout else ""
    finally:
        if proc.poll() is None:
            proc.kill()
    recs = read_records(out / "requests.jsonl")
    aborted = [r for r in recs if r.error and r.error.startswith("aborted")]
    assert 1 <= len(aborted) <= 4  # what was in flight on either worker
    assert len({r.request_id for r in recs}) == len(recs)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["interrupted"] is True
    assert manifest["complete"] is True  # interrupted, but no worker was lost
