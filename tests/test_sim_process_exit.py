"""`servelab sim` as a process ends without freeing its run (``cli.held_to_exit``): the
run directory and the printed table are those of the same command run in-process, where
nothing is held and everything is freed as usual."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

import servelab.cli as cli
from servelab.cli import app, held, held_to_exit
from servelab.cli.load_options import LoadFlags
from servelab.cli.sim import SimFlags, sim_spec
from servelab.sim.loop.simulation import SimResult
from servelab.sim.run import run_sim
from servelab.sim.scenario import Scenario

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
    monkeypatch.setattr(cli, "_end_process", lambda: ended.append(True))
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


@pytest.mark.parametrize(
    ("sweep", "seeds", "results"), [(None, 1, 1), (["max_num_seqs=4,8"], 1, 0), (None, 2, 0)]
)
def test_one_run_holds_its_result_and_a_sweep_or_seeds_hold_none(tmp_path, sweep, seeds, results):
    load = dataclasses.replace(LoadFlags(), requests=30)
    flags = SimFlags(
        hardware="h200",
        model="llama-3.1-8b",
        load=load,
        out=str(tmp_path),
        sweep=sweep,
        seeds=seeds,
    )
    kept: list[object] = []
    with open(os.devnull, "w") as quiet:
        run_sim(sim_spec(flags), Console(file=quiet), keep=kept)
    assert isinstance(kept[0], Scenario)  # a sweep or more seeds free each result as before
    assert [type(x) for x in kept[1:]] == [SimResult] * results
