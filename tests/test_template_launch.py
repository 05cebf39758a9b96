"""bench.servers.template: another server launched from a command template, stopped with its whole
process group, its secrets kept out of the manifest and the log; and a matrix of such servers.

The servers are the bench's stand-in (``python -m servelab.testing.testserver``) or small
Python/shell programs that fail in each way a real server can, all on loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import sys
import time

import pytest

from servelab.bench.manifest import redact, redact_args, secrets_in
from servelab.bench.servers.lifetime import group_members
from servelab.bench.servers.template import TemplateServer, render

PY = shlex.quote(sys.executable)
STAND_IN = f"{PY} -m servelab.testing.testserver --host {{host}} --port {{port}} {{flags}}"


def _gone(pgid: int, within: float = 5.0) -> bool:
    end = time.monotonic() + within
    while group_members(pgid) and time.monotonic() < end:
        time.sleep(0.05)
    return not group_members(pgid)


def test_redact_hides_keys_tokens_headers_and_secret_variables():
    argv = [
        "HF_TOKEN=hf_abcdef",
        "VLLM_CPU_KVCACHE_SPACE=1",
        "vllm",
        "serve",
        "m",
        "--api-key",
        "sk-1234",
        "--hf-token=hf_zzzz",
        "--tokenizer",
        "tok",
        "--max-num-batched-tokens",
        "512",
        "-H",
        "Authorization: Bearer abc123",
    ]
    out = redact(argv)
    assert out == [
        "HF_TOKEN=***",
        "VLLM_CPU_KVCACHE_SPACE=1",
        "vllm",
        "serve",
        "m",
        "--api-key",
        "***",
        "--hf-token=***",
        "--tokenizer",
        "tok",
        "--max-num-batched-tokens",
        "512",
        "-H",
        "Authorization: Bearer ***",
    ]
    assert set(secrets_in(argv)) == {"hf_abcdef", "sk-1234", "hf_zzzz", "abc123"}
    assert redact(["servelab", "bench", "--api-key=k"]) == ["servelab", "bench", "--api-key=***"]


def test_a_template_must_say_where_its_server_listens():
    with pytest.raises(ValueError, match=r"no \{host\}: without it a server may listen"):
        render("vllm serve {model} --port {port} {flags}", "m", 1)
    # an address of the user's own is their choice
    assert render("srv --host 0.0.0.0 --port {port}", "m", 1)[2] == "0.0.0.0"
    assert render("srv --host=::1 --port {port}", "m", 1)[1] == "--host=::1"


def test_render_fills_placeholders_and_refuses_templates_without_a_port():
    argv = render("A=1 srv {model} --host {host} --port {port} {flags}", "my model", 8001, "-x 2")
    assert argv == ["A=1", "srv", "my model", "--host", "127.0.0.1", "--port", "8001", "-x", "2"]
    with pytest.raises(ValueError, match=r"no \{port\}"):
        render("srv {model}", "m", 1)
    with pytest.raises(ValueError, match="unknown placeholder"):
        render("srv --host {host} --port {port} {gpu}", "m", 1)
    with pytest.raises(ValueError, match="names no program"):
        render("A=1 B={port} C={host}", "m", 1)


def test_a_template_that_cannot_start_says_so(tmp_path):
    with pytest.raises(RuntimeError, match="cannot start the server") as e:
        TemplateServer(
            "/nonexistent/llama-server --host {host} --port {port} --api-key sk-never-shown",
            tmp_path / "a.log",
        )
    assert "sk-never-shown" not in str(e.value)
    assert "sk-never-shown" not in (tmp_path / "a.log").read_text()


def test_a_server_that_exits_early_gives_its_code_and_log_and_leaves_nothing(tmp_path):
    tpl = f"{PY} -c 'import sys; print(\"no such model\"); sys.exit(3)' --host {{host}} --port {{port}}"
    srv = TemplateServer(tpl, tmp_path / "b.log")
    with pytest.raises(RuntimeError, match="exited with code 3") as e:
        asyncio.run(srv.wait_healthy(timeout=30))
    assert "no such model" in str(e.value)
    assert _gone(srv.proc.pid)


def test_a_server_that_never_becomes_healthy_is_stopped_with_its_children(tmp_path):
    # The server starts a child of its own (as vLLM starts its engine core) and never listens.
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); time.sleep(300)"
    srv = TemplateServer(
        f"{PY} -c {shlex.quote(code)} --host {{host}} --port {{port}}", tmp_path / "c.log"
    )
    time.sleep(0.5)
    assert len(group_members(srv.proc.pid)) == 2
    with pytest.raises(RuntimeError, match="not healthy .* after 1 s"):
        asyncio.run(srv.wait_healthy(timeout=1.0))
    assert _gone(srv.proc.pid)


def test_a_server_ignoring_sigterm_is_killed(tmp_path):
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
    srv = TemplateServer(
        f"{PY} -c {shlex.quote(code)} --host {{host}} --port {{port}}", tmp_path / "d.log"
    )
    time.sleep(0.3)
    t0 = time.monotonic()
    srv.stop(grace=0.5)
    assert time.monotonic() - t0 < 10 and _gone(srv.proc.pid)


def test_secrets_of_a_template_reach_neither_the_command_nor_the_log(tmp_path):
    # The shell echoes its secrets (as vLLM logs its non-default args), then runs the server.
    tpl = (
        'HF_TOKEN=hf_secret_value sh -c \'echo token=$HF_TOKEN args="$*"; exec "$0" "$@"\' '
        f"{PY} -m servelab.testing.testserver --host {{host}} --port {{port}} --api-key sk-test-secret"
    )
    log = tmp_path / "e.log"
    srv = TemplateServer(tpl, log)
    try:
        asyncio.run(srv.wait_healthy(timeout=60))
    finally:
        srv.stop()
    text = log.read_text()
    assert "token=***" in text and "args=" in text and "READY" in text
    for secret in ("hf_secret_value", "sk-test-secret"):
        assert secret not in text and secret not in json.dumps(srv.command)
    assert "--api-key" in srv.command and _gone(srv.proc.pid)


def test_matrix_launches_templates_and_records_their_redacted_commands(tmp_path):
    from servelab.bench.run import BenchOptions
    from servelab.bench.workloads.request_plan import LoadSpec
    from servelab.workflows.matrix import MatrixSpec, execute_matrix

    spec = MatrixSpec.parse(
        {
            "template": STAND_IN + " --api-key sk-matrix-secret",
            "configs": {"fast": "--itl 0.005", "slow": "--itl 0.02"},
        }
    )
    base = BenchOptions(
        workload="chat",
        load=LoadSpec(rate=40.0, requests=6, length_scale=0.2),
        out=tmp_path / "m",
        quiet=True,
        api_key="sk-matrix-secret",
    )
    res = execute_matrix(spec, base)
    assert set(res.runs) == {"fast", "slow"} and all(res.runs.values())
    man = json.loads((res.out / "slow-r0" / "manifest.json").read_text())
    server = man["server"]
    assert server["launched"] and server["engine_args"] == "--itl 0.02"
    assert "--itl" in server["command"] and "***" in server["command"]
    itl = res.comparison.row("itl", "p50")
    assert itl.verdict(1) == "worse"
    for path in res.out.rglob("*"):
        if path.is_file():
            assert "sk-matrix-secret" not in path.read_text(errors="replace"), path
    assert not [
        p for p in os.listdir(res.out) if p.endswith(".log") and not p.startswith("server-")
    ]


def test_flags_are_recorded_without_their_secrets(tmp_path):
    flags = "--max-num-seqs 4 --api-key sk-flag-secret --hf-token=hf_x1"
    out = redact_args(flags)
    assert "sk-flag-secret" not in out and "hf_x1" not in out
    assert "--max-num-seqs 4" in out and out.count("***") == 2
    plain = '--max-num-batched-tokens 256 --speculative-config \'{"method": "ngram"}\''
    assert redact_args(plain) == plain  # quoting kept where there is nothing to hide
    srv = TemplateServer(STAND_IN, tmp_path / "s.log", flags=flags)
    try:
        assert "sk-flag-secret" not in srv.engine_args + json.dumps(srv.command)
    finally:
        srv.stop()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to split")
def test_servers_started_together_all_keep_off_the_clients_cpu(tmp_path):
    from servelab.bench.servers.target import LaunchedServer, split_cpus

    split = split_cpus()
    if split is None:
        pytest.skip("no taskset")
    client, server_cpus = split
    before = os.sched_getaffinity(0)
    # the first pins this process to the client's CPU; the second must not inherit it
    first = LaunchedServer("smollm2-135m", "", tmp_path / "first.log")
    second = LaunchedServer("smollm2-135m", "", tmp_path / "second.log")
    sleeper = f"{PY} -c 'import time; time.sleep(300)' --host {{host}} --port {{port}}"
    template = TemplateServer(sleeper, tmp_path / "t.log")
    try:
        assert os.sched_getaffinity(0) == client
        for srv in (first, second):
            assert srv.command[:3] == ["taskset", "-c", ",".join(map(str, sorted(server_cpus)))]
        # a template without taskset runs where the client ran before it was pinned
        assert os.sched_getaffinity(template.proc.pid) == before
    finally:
        for srv in (template, second, first):
            srv.stop()
    assert os.sched_getaffinity(0) == before
