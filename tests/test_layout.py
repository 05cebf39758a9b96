"""The house stays readable: `benchmarks/house/layout.py` measures every command and package
folder, and fails past the limits (cli files 300 lines, command bodies 40, 16 modules a
folder); and every command is declared one way, reading its flags as a record's fields."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import typer

from servelab.cli import app

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "house" / "layout.py"


def _layout():  # the script is not in an installed package: load it from its file
    spec = importlib.util.spec_from_file_location("layout", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["layout"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_the_layout_script_lists_every_command_and_passes():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.house.layout"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    for name in typer.main.get_command(app).commands:  # type: ignore[attr-defined]
        assert any(line.split()[:1] == [name] for line in lines), name
    assert any(line.startswith("servelab/sim ") for line in lines)


def test_the_limits_catch_a_long_body_and_a_crowded_folder():
    layout = _layout()

    def short(flags: object) -> None:
        """Docstrings are not counted."""
        print(flags)
        print(flags)

    assert layout.body_lines(short) == 2
    long = layout.Command("long", SCRIPT, 10, layout.MAX_BODY + 1, 1)
    found = layout.problems([long], {"servelab/crowded": layout.MAX_MODULES + 1})
    assert len(found) == 2
    assert "servelab long" in found[0] and "servelab/crowded" in found[1]


def test_every_command_reads_a_flags_record():
    for info in app.registered_commands:
        call = getattr(info.callback, "call", None)
        assert call is not None, f"{info.name} is not declared through command_from_fields"
    text = "\n".join(p.read_text() for p in (ROOT / "src/servelab/cli").glob("*.py"))
    assert 'flags["' not in text and "ctx.params" not in text
