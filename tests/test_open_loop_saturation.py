"""Over-saturation is judged over the open-loop sending window of multi-turn sessions.

Simulated runs of the embedded engine's CPU (`servelab sim --hardware cpu`): the same
workload and loads as `servelab bench --workload chat --rate 2.0 --duration 60s`.
"""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from servelab.analyze.diagnosis.diagnose import diagnose
from servelab.cli import app
from servelab.rundir import load_run


def _sim(out: Path, rate: str) -> Path:
    r = CliRunner().invoke(
        app,
        ["sim", "--hardware", "cpu", "--workload", "chat", "--rate", rate, "--duration", "60s",
         "--out", str(out)],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


def test_over_saturation_is_judged_over_the_open_loop_sending_window(tmp_path):
    # Sessions arrive at 2/s for 60 s, far above what the CPU engine serves: the queue grows
    # all through the sending window; the sessions' later turns then drain it.
    busy = load_run(_sim(tmp_path / "busy", "2"))
    d = diagnose(busy)
    # Over the whole run, drain included, the queue rises and falls: no trend.
    assert d.timeslices is not None and d.timeslices["saturation"]["state"] == "steady"
    found = {f.id: f for f in d.findings}
    assert "over_saturated" in found
    ev = found["over_saturated"].evidence
    assert ev["open_loop_window_s"] < 61 and ev["achieved_rate"] < ev["offered_rate"]
    calm = load_run(_sim(tmp_path / "calm", "0.05"))
    assert "over_saturated" not in {f.id for f in diagnose(calm).findings}
