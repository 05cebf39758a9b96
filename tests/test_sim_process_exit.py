"""`servelab sim` as a process ends without freeing its run (``cli/process_exit.py``): the
run directory and the printed table are those of the same command run in-process, where
nothing is held and everything is freed as usual."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from servelab.cli import app, process_exit
from servelab.cli.process_exit import held, held_to_exit

ARGS = ["sim", "--hardware", "h200", "--model", "llama-3.1-8b", "--requests", "30"]
FILES = ("requests.jsonl", "server.jsonl", "steps.jsonl", "metrics.json")


def _env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}


def _manifest(run: Path) -> dict:
    m = json.loads((run / "manifest.json").read_text())
    for key in ("created", "command"):
        m.pop(key)
    m["sim"].pop("wall_s")
    return m


def test_the_process_writes_what_the_in_process_command_writes(tmp_path):
    proc_dir, plain_dir = tmp_path / "proc" / "run", tmp_path / "plain" / "run"
    cmd = [sys.executable, "-m", "servelab.cli", *ARGS, "--out", str(proc_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    inproc = CliRunner().invoke(app, [*ARGS, "--out", str(plain_dir)])
    assert inproc.exit_code == 0, inproc.output
    for name in FILES:
        assert (proc_dir / name).read_bytes() == (plain_dir / name).read_bytes()
    assert _manifest(proc_dir) == _manifest(plain_dir)
    assert "engine defaults:" in proc.stdout and "output_tok_s" in proc.stdout  # flushed
    assert proc.stdout.rstrip().endswith("┘")
    # a failing command unwinds as usual: its message and status
    again = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert again.returncode == 2 and "already holds a run" in again.stderr


def test_only_main_holds_and_only_a_clean_ending_skips_the_unwinding(monkeypatch):
    assert held() is None  # a library call or CliRunner: nothing outlives the command
    ended: list[bool] = []
    monkeypatch.setattr(process_exit, "_end_process", lambda: ended.append(True))
    with held_to_exit():
        assert held() == []
    assert held() is None and ended == []  # nothing held: the usual ending
    with pytest.raises(SystemExit), held_to_exit():
        held().append(object())  # type: ignore[union-attr]
        raise SystemExit(1)
    assert ended == [] and held() is None
    with pytest.raises(SystemExit), held_to_exit():
        held().append(object())  # type: ignore[union-attr]
        raise SystemExit(0)
    assert ended == [True]
