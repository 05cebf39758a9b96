"""`servelab bench` end to end against the deterministic test server (real HTTP, real CLI)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from typer.testing import CliRunner

from servelab.bench.workloads.request_plan import LoadSpec, build_plan
from servelab.bench.workloads.spec import load_workload
from servelab.cli import app
from servelab.rundir import read_records, server_id
from servelab.testing.testserver import WORDS, Schedule, run_test_server

SECRET = "sk-test-4f9d2c"
FAST = Schedule(ttft=0.02, itl=0.004)


@pytest.fixture(scope="module")
def server():
    with run_test_server(FAST, api_key=SECRET) as url:
        yield url


def bench(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "servelab.cli", "bench", *args],
        capture_output=True,
        check=False,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "160", **(env or {})},
    )


def _served(url: str) -> list[dict]:
    import asyncio

    async def get():
        async with aiohttp.ClientSession() as s, s.get(f"{url}/test/requests") as r:
            return await r.json()

    return asyncio.run(get())


def test_run_directory_from_a_multi_turn_chat_run(server, smollm_tok, tmp_path):
    out = tmp_path / "run"
    p = bench(
        "--url",
        server,
        "--workload",
        "agent",
        "--rate",
        "20",
        "--requests",
        "5",
        "--endpoint",
        "chat",
        "--seed",
        "3",
        "--out",
        str(out),
        "--quiet",
        env={"OPENAI_API_KEY": SECRET},
    )
    assert p.returncode in (0, 3), p.stderr + p.stdout  # 3: valid=False on a loaded machine
    manifest = json.loads((out / "manifest.json").read_text())
    for f in out.iterdir():
        assert SECRET not in f.read_text(errors="replace"), f"API key leaked into {f.name}"
    assert manifest["target_kind"] == "servelab" and manifest["model"] == "test-model"
    assert manifest["valid"] == (p.returncode == 0)
    assert manifest["workload"]["name"] == "agent"

    plan = build_plan(
        load_workload("agent"),
        LoadSpec(rate=20, requests=5),
        3,
        tokenizer=smollm_tok,
        endpoint="chat",
        max_model_len=8192,
    )
    recs = read_records(out / "requests.jsonl")
    by_plan = {r.request_id.split("-", 1)[1]: r for r in recs}
    assert sorted(by_plan) == sorted(r.request_id for r in plan)
    assert all(r.ok for r in recs), [r.error for r in recs if not r.ok]
    # intended send times follow the plan exactly; the client sent close behind them
    firsts = [(p_.send_time, by_plan[p_.request_id]) for p_ in plan if p_.tags.turn == 0]
    t0 = firsts[0][1].intended_send
    for planned, rec in firsts:
        assert rec.intended_send - t0 == pytest.approx(planned, abs=1e-6)
        assert rec.send_lag > -0.002
    for p_ in plan:
        rec = by_plan[p_.request_id]
        assert rec.requested_output_tokens == rec.output_tokens == p_.max_tokens
        assert (rec.session_id, rec.turn) == (p_.tags.session_id, p_.tags.turn)
        if p_.tags.turn > 0:
            assert rec.intended_send >= by_plan[f"r{p_.index - 1:06d}"].done + p_.think_time - 1e-6

    # later turns carry the conversation: the previous answer is in the messages
    bodies = {s["id"]: s["body"] for s in _served(server)}
    later = next(p_ for p_ in plan if p_.tags.turn == 1)
    msgs = bodies[by_plan[later.request_id].sent_request_id]["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    previous = plan[later.index - 1]
    assert msgs[0]["content"] == previous.prompt
    assert msgs[1]["content"] == "".join(WORDS[i % len(WORDS)] for i in range(previous.max_tokens))

    # server timelines joined by request id; metrics summarise every record
    tl_ids = {json.loads(line)["request_id"] for line in (out / "server.jsonl").open()}
    assert {server_id(r) for r in recs} <= tl_ids
    assert all(server_id(r) == r.sent_request_id for r in recs)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["overall"]["latency"]["ttft"]["n"] == len(recs)
    assert metrics["overall"]["requests"]["sent"] == len(recs)
    assert "client" in metrics and metrics["window"]["duration_s"] > 0
    assert "latency" in p.stdout and "throughput" in p.stdout


def test_sweep_runs_stages_and_flushes_the_prefix_cache(server, tmp_path):
    out = tmp_path / "sweep"
    p = bench(
        "--url",
        server,
        "--api-key",
        SECRET,
        "--workload",
        "batch",
        "--sweep",
        "concurrency=1,3",
        "--requests",
        "4",
        "--out",
        str(out),
        "--quiet",
    )
    assert p.returncode in (0, 3), p.stderr + p.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert "--api-key ***" in manifest["command"]
    assert [s["label"] for s in manifest["stages"]] == ["concurrency=1", "concurrency=3"]
    assert all(s["prefix_cache"] == "flushed" for s in manifest["stages"])
    metrics = json.loads((out / "metrics.json").read_text())
    assert [s["label"] for s in metrics["stages"]] == ["concurrency=1", "concurrency=3"]
    recs = read_records(out / "requests.jsonl")
    assert sorted({r.stage for r in recs}) == ["concurrency=1", "concurrency=3"]
    assert all(not r.stream for r in recs)  # the batch preset does not stream
    assert "stages" in p.stdout


def _wait_lines(path: Path, n: int, timeout: float = 60) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} did not reach {n} lines")


def _start(server: str, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "servelab.cli",
            "bench",
            "--url",
            server,
            "--api-key",
            SECRET,
            "--workload",
            "codegen",
            "--length-scale",
            "0.2",
            "--rate",
            "60",
            "--requests",
            "3000",
            "--out",
            str(out),
            "--quiet",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_sigkill_mid_run_leaves_only_complete_records(server, tmp_path):
    out = tmp_path / "killed"
    proc = _start(server, out)
    try:
        _wait_lines(out / "requests.jsonl", 40)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    data = (out / "requests.jsonl").read_bytes()
    assert data.endswith(b"\n")
    lines = data.splitlines()
    assert len(lines) >= 40
    recs = [json.loads(line) for line in lines]  # every line is a whole record
    assert all(r["done"] is not None and r["chunk_times"] for r in recs)


def test_interrupt_records_in_flight_requests_as_aborted(server, tmp_path):
    out = tmp_path / "interrupted"
    proc = _start(server, out)
    try:
        _wait_lines(out / "requests.jsonl", 20)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    recs = read_records(out / "requests.jsonl")
    aborted = [r for r in recs if r.error and r.error.startswith("aborted")]
    assert aborted, "requests in flight at the interrupt were dropped"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["interrupted"] is True
    assert (out / "metrics.json").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sweep", "speed=1,2"], "--sweep rate=0.5,1,2"),
        (["--endpoint", "responses"], "use completions or chat"),
        (["--slo", "ttft=2"], "with a unit"),
        (["--concurrency", "2", "--rate", "1"], "not both"),
        (["--duration", "soon"], "--duration"),
        (["--on-off", "5s"], "ON,OFF"),
        (["--warmup", "abc"], "percentage"),
        (["--workload", "nope"], "neither a preset"),
        (["--find-max-rate", "--sweep", "rate=1,2"], "not both"),
        (["--url", "ftp://x"], "http://"),
        (["--find-max-rate", "--concurrency", "2"], "drop --concurrency"),
        (["--trace", "azure-2023-conv", "--workload", "chat"], "drop --workload"),
        (["--goodput-target", "1.5"], "give a fraction in (0, 1]"),
        (["--slice-duration", "61min"], "give 100ms to 1h"),
    ],
)
def test_bad_flags_say_what_to_do(args, message, tmp_path):
    r = CliRunner().invoke(app, ["bench", "--out", str(tmp_path / "x"), "--quiet", *args])
    text = r.output + (r.stderr if r.stderr_bytes is not None else "")
    assert r.exit_code == 2, text
    assert message in " ".join(text.replace("│", " ").split()), text


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"workers": 0}, "--workers 0: give 1 or more"),
        ({"scrape_interval": 0.01}, "give 50ms to 60s"),
        ({"endpoint": "responses"}, "use completions or chat"),
        ({"load": LoadSpec(rate=1.0)}, "--requests N or --duration"),
    ],
)
def test_bench_options_built_by_hand_are_checked_as_the_cli_checks_them(change, message):
    from servelab.bench.run import BenchOptions, run_bench

    opts = BenchOptions(url="http://127.0.0.1:9", load=LoadSpec(concurrency=1, requests=1))
    with pytest.raises(ValueError, match=message):
        run_bench(replace(opts, **change))


# ------------------------------------------- run.py stops a sweep / fails a search stage
# Planted stage results: each stage's summary is a real ``summarize`` of a few ok records,
# with the over-saturation verdict of analyze/timeslices set by the test, so only the
# verdict decides. The target is the real test server (probe); nothing is sent.
def _planted_stages(monkeypatch, saturated_from: float) -> list[float]:
    from servelab.analyze.summary import summarize
    from servelab.bench.client.monitor import ClientHealth
    from servelab.bench.distributed.clock import timing_error_budget
    from servelab.bench.plan_runner import StageResult
    from servelab.bench.run import Bench
    from servelab.vocab import ClientRecord

    ran: list[float] = []

    async def run_stage(self, stage, http, target):
        rate = stage.load.rate
        ran.append(rate)
        recs = [
            ClientRecord(
                request_id=f"{stage.label}-{k}",
                workload_class="chat",
                intended_send=k * 0.1,
                actual_send=k * 0.1,
                output_tokens=3,
                chunk_times=[k * 0.1 + 0.02 * j for j in (1, 2, 3)],
                chunk_tokens=[1, 1, 1],
                done=k * 0.1 + 0.07,
                status=200,
                stage=stage.label,
            )
            for k in range(5)
        ]
        stage.result = StageResult(
            label=stage.label, start=0.0, end=0.5, sent=len(recs), records=recs
        )
        stage.health = ClientHealth()
        stage.plan_info = {"timing_error_budget_s": timing_error_budget(None)}
        stage.summary = summarize(recs, slos=self._slos())
        verdict = "over_saturated" if rate >= saturated_from else "steady"
        stage.summary["timeslices"]["saturation"]["state"] = verdict

    monkeypatch.setattr(Bench, "_run_stage", run_stage)
    monkeypatch.setattr(Bench, "_plan_inputs", lambda self: None)  # no requests to plan
    return ran


def _run_planted(server, tmp_path, **kw):
    import io

    from rich.console import Console

    from servelab.bench.run import BenchOptions, run_bench
    from servelab.bench.workloads.request_plan import LoadSpec
    from servelab.units import SLO

    out = tmp_path / "run"
    opts = BenchOptions(
        url=server,
        api_key=SECRET,
        model="test-model",
        load=LoadSpec(rate=1.0, requests=5),
        slo=SLO(ttft=10.0),
        out=out,
        quiet=True,
        **kw,
    )
    code = run_bench(opts, Console(file=io.StringIO(), width=160))
    return code, json.loads((out / "manifest.json").read_text())


def test_a_sweep_stops_after_the_first_over_saturated_stage(server, tmp_path, monkeypatch):
    ran = _planted_stages(monkeypatch, saturated_from=2.0)
    code, man = _run_planted(server, tmp_path, sweep=("rate", [1.0, 2.0, 4.0, 8.0]))
    assert code == 0 and ran == [1.0, 2.0]
    assert [s["label"] for s in man["stages"]] == ["rate=1", "rate=2"]
    assert any("rate=2 never reached a steady state" in w for w in man["warnings"])
    assert any("4, 8 were not run" in w for w in man["warnings"])


def test_a_sweep_runs_every_stage_while_each_stays_steady(server, tmp_path, monkeypatch):
    ran = _planted_stages(monkeypatch, saturated_from=float("inf"))
    code, man = _run_planted(server, tmp_path / "s", sweep=("rate", [1.0, 2.0, 4.0]))
    assert code == 0 and ran == [1.0, 2.0, 4.0]
    assert not any("steady state" in w for w in man["warnings"])


def test_find_max_rate_counts_an_over_saturated_stage_as_failing(server, tmp_path, monkeypatch):
    # Every planted stage meets its SLOs (goodput fraction 1.0): only the verdict fails one.
    ran = _planted_stages(monkeypatch, saturated_from=3.0)
    code, man = _run_planted(server, tmp_path, find_max_rate=True)
    best = man["max_rate"]
    assert code == 0 and ran[:3] == [1.0, 2.0, 4.0]
    assert best["failed"] == sorted(r for r in ran if r >= 3.0) and best["failed"]
    assert best["passed"] == sorted(r for r in ran if r < 3.0)
    assert 2.0 <= best["max_rate"] < 3.0 <= best["lowest_failing_rate"] <= 4.0
    assert "rate=4: over-saturated, counted as failing the SLOs" in man["warnings"]
    steady = _planted_stages(monkeypatch, saturated_from=float("inf"))
    _, man = _run_planted(server, tmp_path / "s", find_max_rate=True)
    assert man["max_rate"]["failed"] == [] and max(steady) == man["max_rate"]["max_rate"]


def _id_checking_server(refuse):
    """A server without timelines that answers 400 to a request whose X-Request-Id
    ``refuse(id)`` names a reason for (its body then carries the reason, or is empty for
    None: llama-cpp-python's request-id middleware sends an empty 400 to a non-UUID id)."""
    import asyncio
    import threading

    from aiohttp import web

    seen: list[str | None] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id")
        seen.append(rid)
        if rid is not None and (why := refuse(rid)) is not False:
            if why is None:
                return web.Response(status=400)
            return web.json_response({"error": {"message": why}}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for word in ("a", " b"):
            chunk = {"choices": [{"index": 0, "text": word, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)

    return f"http://127.0.0.1:{port}", seen, stop


def _not_a_uuid(rid: str) -> bool | None:
    import uuid

    try:
        uuid.UUID(rid)
    except ValueError:
        return None
    return False


def _bench_against(refuse, tmp_path, *flags: str) -> tuple[int, list, list, dict, str]:
    import io

    from rich.console import Console

    from servelab.bench.run import BenchOptions, run_bench

    url, seen, stop = _id_checking_server(refuse)
    out = io.StringIO()
    try:
        opts = BenchOptions(url=url, model="m", load=LoadSpec(concurrency=2, requests=4),
                            out=tmp_path / "run", quiet=True,
                            request_id_header="--no-request-id-header" not in flags)  # fmt: skip
        code = run_bench(opts, Console(file=out, width=300))
    finally:
        stop()
    records = read_records(tmp_path / "run" / "requests.jsonl")
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    # The server answers from a thread of this process, so a short run can make the client's
    # self-check (its CPU, its event-loop lag) call the run invalid; that verdict is about the
    # machine, not about the ids these tests check, so it reads as a clean exit here.
    own = [r for st in manifest["stages"] if st["client"] for r in st["client"]["reasons"]]
    if code == 3 and own:
        assert manifest["invalid_reason"] == "; ".join(own)
        code = 0
    return code, records, seen, manifest, out.getvalue()


def test_every_server_gets_a_uuid_request_id(tmp_path):
    # llama-cpp-python's server refuses ids that are not UUIDs; servelab sends a UUID, which it
    # takes, so the records of a run against any server join that server's own by id.
    code, records, seen, manifest, _ = _bench_against(_not_a_uuid, tmp_path)
    assert code == 0 and len(records) >= 4 and all(r.ok for r in records)
    assert len(seen) == len(records) and None not in seen
    assert sorted(seen) == sorted(r.sent_request_id for r in records)
    assert manifest["config"]["request_id_header"] == "a UUID per request"
    assert not [w for w in manifest["warnings"] if "X-Request-Id" in w]


def test_a_server_that_refuses_the_request_id_is_reported_and_the_run_goes_on(tmp_path):
    def refuse(rid: str) -> str:
        return f"unexpected header X-Request-Id: {rid}"

    code, records, seen, manifest, printed = _bench_against(refuse, tmp_path)
    assert code == 0 and len(records) >= 4 and all(r.ok for r in records)
    assert all(r.sent_request_id is None for r in records)  # each was sent again, without it
    # the first requests (2 in flight) went with the header, and each again without it
    assert seen.count(None) == len(records) and 1 <= len(seen) - len(records) <= 2
    (warning,) = [w for w in manifest["warnings"] if "X-Request-Id" in w]
    assert "refused the X-Request-Id header (http_400: unexpected header X-Request-Id" in warning
    assert "went on without it" in warning
    assert printed.count("refused the X-Request-Id header") == 1
    assert manifest["config"]["request_id_header"] == "refused by the server: sent without it"


def test_no_request_id_header_sends_none(tmp_path):
    code, records, seen, manifest, _ = _bench_against(
        _not_a_uuid, tmp_path, "--no-request-id-header"
    )
    assert code == 0, manifest.get("invalid_reason")
    assert all(r.ok for r in records) and set(seen) == {None}
    assert all(r.sent_request_id is None for r in records)
    assert manifest["config"]["request_id_header"] == "off (--no-request-id-header)"


def test_the_recount_warning_only_where_the_tokenizers_can_differ():
    """A differing re-count is worth a warning only where the client's tokenizer may not be
    the server's: a servelab server serving the model the tokenizer is named after, or one
    answering /tokenize, counts with the client's own."""
    from rich.console import Console

    from servelab.bench.run import Bench, BenchOptions
    from servelab.bench.servers.target import ServerInfo

    def same(tokenizer: str, timelines: bool, model: str, source: str = "--tokenizer") -> bool:
        b = Bench(BenchOptions(url="http://x", tokenizer=tokenizer), Console())
        b.info = ServerInfo("http://x", models=[{"id": model}], timelines=timelines)
        b.tokenizer_source = source
        return b._servers_tokenizer()

    assert same("smollm2-135m", True, "smollm2-135m")  # the embedded engine
    assert not same("smollm2-135m", False, "smollm2-135m")  # another server's own counting
    assert not same("gpt2", True, "smollm2-135m")  # a servelab server, another model
    assert same("gpt2", False, "m", source="server /tokenize")


def test_cold_connections_are_opened_in_the_window_and_the_manifest_says_so(server, tmp_path):
    out = tmp_path / "cold"
    p = bench("--url", server, "--api-key", SECRET, "--workload", "chat", "--requests", "6",
              "--concurrency", "3", "--cold-connections", "--out", str(out), "--quiet")  # fmt: skip
    assert p.returncode in (0, 3), p.stdout + p.stderr  # 3: written, but a busy machine's client
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["connections"] == "cold"
    assert manifest["stages"][0]["plan"]["connections"] == {"mode": "cold"}
    recs = read_records(out / "requests.jsonl")
    # each of the 3 streams opened its own connection, its set-up inside its first TTFT
    assert sum(bool(r.new_connection) for r in recs) == 3
    assert all(r.connect_time is not None for r in recs if r.new_connection)
