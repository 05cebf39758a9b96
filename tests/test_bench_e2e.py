"""`servelab bench` with no --url: it starts the embedded `servelab serve` (real weights, real
HTTP), runs a small workload, stops the server, and leaves a complete run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from servelab.bench.workloads.request_plan import LoadSpec, build_plan
from servelab.bench.workloads.spec import load_workload
from servelab.rundir import read_records

pytestmark = pytest.mark.slow

WORKLOAD = """
name: tiny
classes:
  - name: tiny
    input: 24
    output: 6
    prefix:
      - {name: system, count: 1, tokens: 32, reuse: 1.0}
    slo: {ttft: 60s}
"""


def test_bench_against_the_embedded_server(tmp_path):
    from servelab.modelcore.tokenizer import Tokenizer

    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(WORKLOAD)
    out = tmp_path / "run"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "servelab.cli",
            "bench",
            "--workload",
            str(spec_file),
            "--requests",
            "4",
            "--concurrency",
            "2",
            "--seed",
            "1",
            "--engine-args",
            "--max-num-seqs 4",
            "--out",
            str(out),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
        env={**os.environ, "COLUMNS": "160"},
    )
    assert p.returncode in (0, 3), p.stdout + p.stderr + (out / "server.log").read_text()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target_kind"] == "servelab" and manifest["server"]["launched"]
    assert manifest["server"]["config"] == {"max_num_seqs": 4}
    assert manifest["stages"][0]["prefix_cache"] == "flushed"
    assert "stopped" in (out / "server.log").read_text()  # the child was shut down

    tok = Tokenizer.from_model("smollm2-135m")
    plan = build_plan(
        load_workload(str(spec_file)),
        LoadSpec(concurrency=2, requests=4),
        1,
        tokenizer=tok,
        max_model_len=manifest["server"]["max_model_len"],
    )
    recs = {r.request_id.split("-", 1)[1]: r for r in read_records(out / "requests.jsonl")}
    assert sorted(recs) == sorted(r.request_id for r in plan)
    for planned in plan:
        rec = recs[planned.request_id]
        assert rec.ok, rec.error
        assert rec.token_source == "usage"
        # the server counted exactly the planned prompt, and honoured the exact output length
        assert rec.input_tokens == planned.prompt_tokens == 56
        assert rec.output_tokens == rec.requested_output_tokens == 6
        assert sum(rec.chunk_tokens) == 6 and rec.ttft is not None and rec.ttft > 0

    timelines = {}
    for line in (out / "server.jsonl").open():
        tl = json.loads(line)
        timelines[tl["request_id"]] = tl
    for rec in recs.values():
        tl = timelines[rec.server_timeline["request_id"]]
        assert tl["output_tokens"] == rec.output_tokens
        # same host, same clock: the server got the request after the client sent it
        assert rec.actual_send <= tl["arrival"] <= rec.chunk_times[0]
    # the shared 32-token system prompt is served from the prefix cache after the first use
    assert max(tl["cached_tokens"] for tl in timelines.values()) >= 32
    assert (out / "steps.jsonl").read_text().strip()
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["overall"]["requests"]["ok"] == 4
