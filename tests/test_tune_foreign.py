"""`servelab tune` on another server's run: replayed on the twin calibrated on it, candidates
in that server's own flags, and `--verify` by relaunching it from a command template.

The server is a stand-in for vLLM (``tests/standin_vllm.py``: the bench's test server with
planted engine steps, configured by vLLM's scheduler flags): no step records, no timelines,
only what the client saw, as with a real vLLM. Prompts are counted by a word-level tokenizer,
as the test server counts them, so the planned requests rebuild exactly.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shlex
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from servelab.analyze.diagnosis.findings import Finding
from servelab.analyze.tuning.candidates import RunFacts, for_server, generate, launch_action
from servelab.analyze.tuning.decision import Objective, decide, judge
from servelab.bench.run import BenchOptions, run_bench
from servelab.bench.servers.template import TemplateServer
from servelab.bench.workloads.request_plan import LoadSpec
from servelab.cli import app
from servelab.rundir import load_run
from servelab.sim.fit.asrun import is_foreign
from servelab.workflows.matrix import record_server
from servelab.workflows.tuning_loop import TuneSpec, predict, server_template, verify_choice

runner = CliRunner()
STANDIN = Path(__file__).with_name("standin_vllm.py")
TEMPLATE = f"{shlex.quote(sys.executable)} {STANDIN} --host {{host}} --port {{port}} {{flags}}"
AS_RUN_FLAGS = "--no-enable-chunked-prefill --no-enable-prefix-caching"
# The verify tests are about the relaunch, not the self-check: on a loaded machine the
# eight-request run itself strays from its replay, and they must still get a prediction.
ANY = 0.99


def _word_tokenizer(d: Path) -> Path:
    """One token per whitespace-separated word: the test server's own count."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d.mkdir(parents=True, exist_ok=True)
    words = ["[UNK]", "the", "of", "and", "to", "in", "a", "is", "that"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(d / "tokenizer.json"))
    (d / "config.json").write_text("{}")
    return d


@pytest.fixture(scope="module")
def foreign_run(tmp_path_factory) -> Path:
    """Mixed chat and RAG traffic on the stand-in vLLM without chunked prefill, launched
    from the template (recorded in the manifest, as the matrix records it)."""
    root = tmp_path_factory.mktemp("foreign")
    tok = _word_tokenizer(root / "tok")
    out = root / "mixed"
    server = TemplateServer(TEMPLATE, root / "server.log", "test-model", AS_RUN_FLAGS)
    try:
        asyncio.run(server.wait_healthy(timeout=30))
        opts = BenchOptions(
            url=server.url,
            model="test-model",
            tokenizer=str(tok),
            workload="mixed",
            load=LoadSpec(concurrency=4, requests=8, length_scale=1.0),
            out=out,
            quiet=True,
            seed=1,
            server_config=f"vllm serve test-model {AS_RUN_FLAGS}",
        )
        code = run_bench(opts, Console(file=io.StringIO(), width=160))
        record_server(out, server)
    finally:
        server.stop()
    assert code in (0, 3)  # 3: a loaded machine may mark the client invalid
    return out


@pytest.fixture(autouse=True)
def _prefill_finding(monkeypatch):
    """Whether the eight-request run's stalls cross the interference finding's thresholds
    turns on milliseconds (on a loaded machine they did not, and only replicas were
    proposed). These tests are about the tune loop on another server's run, not that
    finding, so its diagnosis always carries the finding that calls for chunked prefill."""
    from servelab.analyze.diagnosis import diagnose as diagnosis
    from servelab.workflows import tuning_loop

    def diagnose(run):
        d = diagnosis.diagnose(run)
        if not any("chunked_prefill" in f.levers for f in d.findings):
            d.findings.append(
                Finding(
                    id="itl_prefill_interference",
                    title="ITL spikes line up with long prefills",
                    summary="added by the test",
                    evidence={},
                    confidence=0.9,
                    exact=False,
                    levers=["chunked_prefill"],
                )
            )
        return d

    monkeypatch.setattr(tuning_loop, "diagnose", diagnose)


def _copy(src: Path, dst: Path, **server: object) -> Path:
    shutil.copytree(src, dst)
    man = json.loads((dst / "manifest.json").read_text())
    man["server"].update(server)
    (dst / "manifest.json").write_text(json.dumps(man))
    return dst


def test_a_foreign_run_is_predicted_through_its_twin_in_its_own_flags(foreign_run):
    run = load_run(foreign_run)
    assert is_foreign(run) and not run.timelines
    # Eight requests at four at once: whether a prompt's prefill shares a step with another
    # request's decode turns on milliseconds, so a class's tail moves by 20% between runs,
    # and more on a loaded machine. This test is about the prediction's shape, so the
    # self-check passes at any tolerance here (its refusal has a test of its own), and what
    # its halves are too small to check is predicted anyway.
    t = predict(run, TuneSpec(foreign_run, seeds=3, jobs=1, tolerance=ANY, ignore_gates=True))
    assert t.refused is None, t.refused
    assert t.check is not None and t.check.ok and t.check.rows
    assert t.server == "vllm" and t.twin is not None
    assert t.twin["engine_config"]["enable_chunked_prefill"] is False
    assert t.twin["engine_sources"]["enable_chunked_prefill"] == "the launch command"
    # Only what vLLM's flags can set is predicted; class priorities are not.
    ids = {j.candidate.id for j in t.judged}
    assert "chunk-256" in ids and not any(j.candidate.priorities for j in t.judged)
    assert t.decision is not None
    chunk = next(j.candidate for j in t.judged if j.candidate.id == "chunk-256")
    assert launch_action(t.server, chunk.engine) == (
        "vllm serve --enable-chunked-prefill --max-num-batched-tokens 256"
    )
    # Each seed after the first ran on its own draw of the twin: the replay has a range.
    seeds = [s["overall"]["ttft_p95"] for s in t.baseline.seeds] if t.baseline else []
    assert len(set(seeds)) > 1
    args = ["tune", str(foreign_run), "--seeds", "3", "--jobs", "1", "--ignore-gates"]
    r = runner.invoke(app, args)  # eight requests: past the gate that asks for more
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert "twin of this vllm server" in said
    assert "apply:" not in said or "vllm serve --" in said


def test_candidates_are_kept_to_what_the_servers_own_flags_set():
    findings = [
        Finding(id=f, title=f, summary="", evidence={}, confidence=0.9, exact=True, levers=[lever])
        for f, lever in (
            ("queue_bound", "priorities"),
            ("itl_prefill_interference", "chunked_prefill"),
            ("kv_pressure", "kv_memory"),
            ("prefill_bound", "disaggregation"),
        )
    ]
    facts = RunFacts(
        config={"enable_chunked_prefill": False, "max_num_batched_tokens": 8192,
                "num_kv_blocks": 100, "kv_cache_memory_gb": 1.0},
        prompt_tokens=[300, 900], priorities={"chat": 0, "rag": 1}, peak_seqs=4,
    )  # fmt: skip
    cands, skipped = generate(findings, facts, ("overall", "goodput"))
    assert any(c.priorities for c in cands) and any(c.knob == "kv_memory" for c in cands)
    assert for_server("servelab", cands, skipped) == (cands, skipped)
    kept, why = for_server("vllm", cands, skipped)
    assert not any(c.priorities for c in kept)
    assert "priority scheduling" in {u.lever: u.reason for u in why}["priorities"]
    assert "another server" in {u.lever: u.reason for u in why}["disaggregation"]
    # vLLM sets the KV pool by its block count; llama.cpp has neither that flag nor a switch
    # for chunking.
    kv = next(c for c in kept if c.knob == "kv_memory")
    assert launch_action("vllm", kv.engine) == "vllm serve --num-gpu-blocks-override 150"
    kept, why = for_server("llamacpp", cands, skipped)
    assert {c.knob for c in kept} == {"chunking"}
    assert all(c.engine["max_num_batched_tokens"] for c in kept)
    assert "no launch flag for num_kv_blocks" in " ".join(u.reason for u in why)
    chunk = next(c for c in kept if c.id == "chunk-512")
    assert launch_action("sglang", chunk.engine) == (
        "python -m sglang.launch_server --chunked-prefill-size 512"
    )


def test_the_self_check_refuses_a_twin_told_the_wrong_settings(foreign_run, tmp_path):
    # Stated as one sequence at a time, the twin serialises what the server ran four at once.
    wrong = _copy(
        foreign_run,
        tmp_path / "wrong",
        stated_command=["vllm", "serve", "test-model", "--max-num-seqs", "1"],
    )
    t = predict(load_run(wrong), TuneSpec(wrong, seeds=2, jobs=1))
    assert t.twin is not None and t.twin["engine_config"]["max_num_seqs"] == 1
    assert t.refused is not None and "strays" in t.refused
    assert t.decision is None and t.check is not None and t.check.strayed


def test_tune_predicts_from_the_twin_file_given_and_checks_it_fits_the_run(foreign_run, tmp_path):
    from servelab.sim.fit.twin import calibrate_runs
    from servelab.workflows.tuning_loop import twin_replica

    run = load_run(foreign_run)
    cal = calibrate_runs([run])
    planted = {k: 2 * v for k, v in cal.cost.items()}
    path = replace(cal, cost=planted, run="two launches").save(tmp_path / "twin.json")
    spec = TuneSpec(foreign_run, seeds=2, jobs=1, calibration=path)
    replica, _ = twin_replica(run, spec)
    assert replica.twin is not None and replica.twin.run == "two launches"
    t = predict(run, spec)
    assert t.twin is not None and t.twin["cost"] == planted  # not a twin fitted to the run
    # a twin of another server, or of other settings than the run stated, is refused
    other = replace(cal, server="sglang").save(tmp_path / "sglang.json")
    with pytest.raises(ValueError, match="a twin of sglang"):
        twin_replica(run, replace(spec, calibration=other))
    values = {**cal.settings["values"], "enable_chunked_prefill": True}
    chunked = replace(cal, settings={**cal.settings, "values": values})
    with pytest.raises(ValueError, match="other settings .*enable_chunked_prefill"):
        twin_replica(run, replace(spec, calibration=chunked.save(tmp_path / "chunked.json")))
    # without a file, the twin fitted to the run takes the launch command stated now
    stated, _ = twin_replica(
        run, replace(spec, calibration=None, server_config="vllm serve test-model --max-num-seqs 2")
    )
    assert stated.twin is not None and stated.twin.engine_config["max_num_seqs"] == 2
    r = runner.invoke(
        app,
        [
            "tune",
            str(foreign_run),
            "--ignore-gates",
            "--calibration",
            str(foreign_run / "manifest.json"),
        ],
    )
    assert r.exit_code == 2 and "not a twin file" in " ".join(r.output.split())


def _force_chunk_256(run, spec):
    """Predict, then make chunked prefill at 256 tokens the choice whatever was decided."""
    t = predict(run, spec)
    assert t.refused is None and t.baseline is not None, t.refused
    j = next(j for j in t.judged if j.candidate.id == "chunk-256")
    obj = Objective.parse(None, has_slos=True)
    t.decision = decide([], obj)
    t.decision.chosen = judge(t.baseline, j.candidate, j.prediction, obj)
    return t


def test_verify_relaunches_the_server_from_its_template_as_run_and_tuned(foreign_run, tmp_path):
    run = load_run(foreign_run)
    spec = TuneSpec(
        foreign_run, seeds=2, jobs=1, verify=True, repeats=1, out=tmp_path / "v", tolerance=ANY,
        trust_run_template=True, ignore_gates=True,
    )  # fmt: skip
    t = _force_chunk_256(run, spec)
    console = Console(record=True, width=200)
    v = verify_choice(run, t, spec, console)
    said = " ".join(console.export_text().split())
    assert "--max-num-batched-tokens 256'" in said and "this takes about" in said
    # the recorded template, then each command, printed before it runs
    assert f"records (--trust-run-template): {TEMPLATE}" in said
    assert said.count(f"launching: {shlex.quote(sys.executable)} {STANDIN}") == 2
    tuned = json.loads((tmp_path / "v" / "tuned-r0" / "manifest.json").read_text())["server"]
    assert tuned["engine_args"] == f"{AS_RUN_FLAGS} --enable-chunked-prefill " + (
        "--max-num-batched-tokens 256"
    )
    as_run = json.loads((tmp_path / "v" / "as-run-r0" / "manifest.json").read_text())["server"]
    assert as_run["engine_args"] == AS_RUN_FLAGS
    rows = {(r.config, r.scope, r.name): r for r in v.rows}
    as_run, tuned = (rows[(c, "overall", "max_itl_mean")] for c in ("as-run", "tuned"))
    assert as_run.predicted is not None and tuned.predicted is not None
    assert as_run.measured is not None and tuned.measured is not None
    # Chunking the RAG prompts shortens the longest stalls, predicted and measured.
    assert tuned.predicted.median < 0.8 * as_run.predicted.median
    assert tuned.measured < 0.8 * as_run.measured
    assert v.arms[0].objective.p_value is not None


def _alive(marker: str) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmd:
            out.append(int(pid))
    return out


def test_verify_without_a_template_or_with_one_that_never_comes_up(foreign_run, tmp_path):
    bare = _copy(foreign_run, tmp_path / "bare", launched=False, template=None)
    r = runner.invoke(app, ["tune", str(bare), "--verify", "--seeds", "2", "--jobs", "1"])
    assert r.exit_code == 2 and "--server-template" in " ".join(r.output.split())
    marker = f"never-healthy-{os.getpid()}"
    hangs = f"{shlex.quote(sys.executable)} -c 'import time; time.sleep(120)' {marker} --host {{host}} --port {{port}}"
    spec = TuneSpec(
        bare, seeds=2, jobs=1, verify=True, repeats=1, out=tmp_path / "v",
        server_template=f"{hangs} {{flags}}", health_timeout=1.0, tolerance=ANY,
        ignore_gates=True,
    )  # fmt: skip
    t = _force_chunk_256(load_run(bare), spec)
    with pytest.raises(RuntimeError, match="not healthy"):
        verify_choice(load_run(bare), t, spec, Console(file=io.StringIO()))
    assert _alive(marker) == []


def test_a_template_with_a_secret_is_recorded_redacted_and_not_relaunched(foreign_run, tmp_path):
    secret = "sk-tune-secret-42"
    server = TemplateServer(f"{TEMPLATE} --api-key {secret}", tmp_path / "log", "m", "")
    server.stop()
    assert secret not in server.template and "--api-key ***" in server.template
    assert secret not in (tmp_path / "log").read_text()
    recorded = _copy(foreign_run, tmp_path / "r", template=server.template)
    with pytest.raises(ValueError, match="redacted; pass the template again"):
        server_template(load_run(recorded), None)
    assert server_template(load_run(recorded), "given {port}") == "given {port}"


def test_a_template_from_the_run_directory_runs_only_when_trusted(foreign_run, tmp_path):
    out = tmp_path / "v"
    r = runner.invoke(
        app,
        ["tune", str(foreign_run), "--verify", "--seeds", "2", "--jobs", "1", "--out", str(out)],
    )
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and "--trust-run-template" in said
    assert TEMPLATE in said  # printed in full
    assert not out.exists() and _alive(str(STANDIN)) == []  # refused before anything ran
