"""`servelab report --trace-json`: a Chrome Trace Event file Perfetto opens as is."""

from __future__ import annotations

import json

from rundirs import unchunked_stalls
from typer.testing import CliRunner

from servelab.cli import app

_PHASES = {"X", "M"}


def _validate(doc: dict) -> list[dict]:
    """The Trace Event format's required fields, as chrome://tracing's importer reads them."""
    events = doc["traceEvents"]
    for e in events:
        assert {"ph", "ts", "pid", "tid", "name"} <= set(e), e
        assert e["ph"] in _PHASES
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0
        else:
            assert e["name"] in ("process_name", "thread_name") and e["args"]["name"]
    return events


def test_trace_json_has_every_request_phase_and_engine_step(tmp_path):
    run_dir = unchunked_stalls(tmp_path / "u")
    out = tmp_path / "trace.json"
    res = CliRunner().invoke(app, ["report", str(run_dir), "--trace-json", str(out)])
    assert res.exit_code == 0, res.output
    events = _validate(json.loads(out.read_text()))
    names = {e["name"].split(":")[0] for e in events if e["ph"] == "X"}
    assert {"queued", "prefill chunk", "decode", "stall"} <= names
    steps = [e for e in events if e.get("cat") == "step"]
    n_steps = sum(1 for _ in (run_dir / "steps.jsonl").open())
    assert len(steps) == n_steps and {e["pid"] for e in steps} == {2}
    n_requests = sum(1 for _ in (run_dir / "requests.jsonl").open())
    threads = [e for e in events if e["name"] == "thread_name"]
    assert len(threads) == n_requests
    # The unchunked 3000-token prompts show as one chunk each, beside the stalls they cause.
    chunks = [e for e in events if e["name"] == "prefill chunk"]
    assert max(e["args"]["tokens"] for e in chunks) == 3000
