"""The core install's promises, checked from the source tree (.ci/wheel-check.sh checks the
built wheel): no engine package among the core dependencies, engine commands that say which
extra they need, and GGUF metadata read without the gguf package."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from servelab.cli import app

ROOT = Path(__file__).resolve().parents[1]
ENGINE_ONLY = ("torch", "gguf", "safetensors", "transformers", "pyzmq")


def _name(req: str) -> str:
    return req.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip()


def test_the_core_dependencies_hold_no_engine_package():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_name(r) for r in project["dependencies"]}
    assert not core & set(ENGINE_ONLY)
    engine = {_name(r) for r in project["optional-dependencies"]["engine"]}
    assert {"torch", "gguf", "safetensors", "pyzmq"} <= engine
    torch = next(r for r in project["optional-dependencies"]["engine"] if _name(r) == "torch")
    assert ">=" in torch and "==" not in torch  # a range, so it installs beside vLLM's torch


@pytest.mark.parametrize(
    "args",
    [
        ["serve"],
        ["generate", "-p", "hi"],
        ["offline-demo"],
        ["export-hf", "/tmp/never-written"],
        ["profile"],
        ["demo", "--quick"],
        ["bench", "--requests", "1"],  # no --url: the embedded engine
    ],
)
def test_engine_commands_without_the_engine_say_which_extra(args, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "torch" else real(n, *a)
    )
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    assert "pip install 'servelab[engine]'" in r.output and "torch" in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_version_flag():
    from servelab import __version__

    assert CliRunner().invoke(app, ["--version"]).output.strip() == __version__


def test_gguf_metadata_and_tensor_names_without_the_gguf_package():
    from servelab.modelcore.catalogue import resolve_model
    from servelab.modelcore.gguf_meta import GGUFValueType, tensor_names

    gguf = pytest.importorskip("gguf")
    assert {t.name: int(t) for t in GGUFValueType} == {t.name: int(t) for t in gguf.GGUFValueType}
    try:
        path = resolve_model("smollm2-135m")
    except ValueError as e:
        pytest.skip(f"default model not installed: {e}")
    assert tensor_names(path) == {t.name for t in gguf.GGUFReader(str(path)).tensors}


def test_importing_the_cli_loads_no_torch_and_no_model_runtime():
    # A fresh interpreter: this test process may already hold torch from other tests.
    code = (
        "import sys, servelab.cli\n"
        "heavy = sorted(m for m in sys.modules if m in ('torch', 'gguf', 'safetensors')"
        " or m == 'servelab.model' or m.startswith('servelab.model.'))\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_core_dependencies_hold_no_scipy_and_the_fit_extra_does():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "scipy" not in {_name(r) for r in project["dependencies"]}
    assert "scipy" in {_name(r) for r in project["optional-dependencies"]["fit"]}


def test_a_fit_without_scipy_says_which_extra_in_one_line(tmp_path):
    # the core commands run without scipy; a fit (here calibrate) names the extra, exit 2
    blocked = "import sys; sys.modules['scipy'] = None\nfrom servelab.cli import main\n"
    run = tmp_path / "sim"

    def servelab(*args: str) -> subprocess.CompletedProcess[str]:
        code = blocked + f"sys.argv = ['servelab', *{list(args)!r}]\nmain()\n"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)

    sim = servelab(
        "sim", "--hardware", "h100", "--model", "qwen2.5-7b", "--workload", "chat",
        "--requests", "20", "--out", str(run),
    )  # fmt: skip
    assert sim.returncode == 0, sim.stderr
    r = servelab("calibrate", str(run), "--hardware", "h100", "--model", "qwen2.5-7b")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "pip install 'servelab[fit]'" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
