"""`servelab bench --workers N`: local worker processes, and Ray actors on a local cluster,
against the deterministic test server. Every test runs in both modes: one schedule dealt
by session, started together, recorded whole, and equal to a single-process run."""

from __future__ import annotations

import io
import itertools
import json
import os
import signal
from pathlib import Path
from statistics import median

import aiohttp
import pytest
import yaml
from rich.console import Console
from scipy import stats

from servelab.bench.distributed.driver import WorkerPool
from servelab.bench.plan_runner import START_DELAY_S
from servelab.bench.run import BenchOptions, run_bench
from servelab.bench.workloads.request_plan import LoadSpec, build_plan, iter_plan
from servelab.bench.workloads.spec import load_workload
from servelab.rundir import read_records
from servelab.testing.testserver import Schedule, run_test_server
from servelab.vocab import ClientRecord

pytestmark = pytest.mark.slow

WORKLOAD = {
    "name": "dist",
    "classes": [
        {"name": "single", "weight": 1, "input": 16, "output": 6},
        {
            "name": "conv",
            "weight": 1,
            "input": 12,
            "output": 4,
            "session": {
                "turns": {"dist": "uniform", "min": 2, "max": 3},
                "think_time": "20ms",
            },
        },
    ],
}
RATE = 25.0
SESSIONS = 40
SEED = 5
SEND_TOLERANCE_S = 0.05  # the client's own validity bound on send lag (monitor.py)
MAX_MODEL_LEN = 8192  # the test server's


@pytest.fixture(scope="module")
def server():
    with run_test_server(Schedule(ttft=0.02, itl=0.004)) as url:
        yield url


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("wl") / "dist.yaml"
    path.write_text(yaml.safe_dump(WORKLOAD))
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_llama_dir):
    return str(tiny_llama_dir)


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(params=["processes", "ray"])
def mode(request) -> dict:
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
        return {"ray_address": "auto"}
    return {}


class Run:
    def __init__(self, out: Path, code: int):
        self.out = out
        self.code = code
        self.manifest = json.loads((out / "manifest.json").read_text())
        self.records = read_records(out / "requests.jsonl")
        self.stage = self.manifest["stages"][0]
        self.dist = self.stage["plan"].get("distributed")
        self.tag = self.manifest["config"]["run_tag"]

    def by_id(self) -> dict[str, ClientRecord]:
        return {r.request_id.removeprefix(self.tag + "-"): r for r in self.records}

    @property
    def timed(self) -> bool:
        """The run's own self-check passed: its timing can be held to the tolerances.
        (On a loaded 2-core machine a worker may say it fell behind; the run is then
        complete but marked invalid, exit code 3, and only its structure is checked.)"""
        return self.manifest["valid"]

    def assert_complete(self) -> None:
        assert self.code in (0, 3), self.manifest["invalid_reason"]
        assert self.manifest["complete"] and self.dist["complete"]
        assert self.code == 0 or "incomplete" not in self.manifest["invalid_reason"]


def bench(server, spec_file, tokenizer_dir, out: Path, load: LoadSpec, **kw) -> Run:
    opts = BenchOptions(
        url=server,
        tokenizer=tokenizer_dir,
        workload=str(spec_file),
        load=load,
        seed=SEED,
        out=out,
        quiet=True,
        **kw,
    )
    code = run_bench(opts, console=Console(file=io.StringIO(), width=160))
    return Run(out, code)


def served_workers(url: str, run: Run) -> dict[str, str]:
    """planned request id -> the X-Servelab-Worker header it reached the server with (the
    server knows each request by the id the bench sent it, joined back through the records)."""
    planned = {
        r.sent_request_id or r.request_id: r.request_id.removeprefix(run.tag + "-")
        for r in run.records
    }
    import asyncio

    async def get():
        async with aiohttp.ClientSession() as s, s.get(f"{url}/test/requests") as r:
            return await r.json()

    return {
        planned[d["id"]]: d["headers"].get("X-Servelab-Worker")
        for d in asyncio.run(get())
        if d["id"] in planned
    }


def the_plan(spec_file, tokenizer_dir, load: LoadSpec):
    from servelab.modelcore.tokenizer import Tokenizer

    tok = Tokenizer.from_model(tokenizer_dir)
    return build_plan(
        load_workload(str(spec_file)), load, SEED, tokenizer=tok, max_model_len=MAX_MODEL_LEN
    )


@pytest.fixture(scope="module")
def single(server, spec_file, tokenizer_dir, tmp_path_factory) -> Run:
    """The same workload and seed in one process: the reference."""
    load = LoadSpec(rate=RATE, requests=SESSIONS)
    return bench(server, spec_file, tokenizer_dir, tmp_path_factory.mktemp("single") / "r", load)


def test_open_loop_sessions_one_schedule_many_workers(
    mode, server, spec_file, tokenizer_dir, tmp_path, single
):
    load = LoadSpec(rate=RATE, requests=SESSIONS)
    run = bench(server, spec_file, tokenizer_dir, tmp_path / "r", load, workers=2, **mode)
    plan = the_plan(spec_file, tokenizer_dir, load)
    run.assert_complete()

    # complete, no duplicates, exactly the plan
    recs = run.by_id()
    assert len(recs) == len(run.records) == len(plan)
    assert all(r.ok for r in run.records)
    start = run.stage["start"]
    for p in plan:
        r = recs[p.request_id]
        assert (r.workload_class, r.session_id, r.turn) == (
            p.tags.workload_class,
            p.tags.session_id,
            p.tags.turn,
        )
        assert r.requested_output_tokens == p.max_tokens == r.output_tokens
        if p.tags.turn == 0:  # the union of the sub-schedules is the planned schedule
            assert r.intended_send - start == pytest.approx(START_DELAY_S + p.send_time, abs=1e-6)
            assert not run.timed or abs(r.send_lag) <= SEND_TOLERANCE_S

    # sessions kept whole, on both workers, as the server saw them
    seen = served_workers(server, run)
    assert set(seen) == set(recs) and set(seen.values()) == {"0", "1"}
    for _, turns in itertools.groupby(plan, key=lambda p: p.tags.session_id or p.request_id):
        assert len({seen[p.request_id] for p in turns}) == 1

    # aggregate arrivals: the superposition of the workers' sends is the planned Poisson
    sends = sorted(r.actual_send for r in run.records if r.turn == 0)
    gaps = [b - a for a, b in itertools.pairwise(sends)]
    assert len(gaps) == SESSIONS - 1
    assert sum(gaps) / len(gaps) == pytest.approx(1 / RATE, rel=0.5)
    if run.timed:
        assert stats.kstest(gaps, "expon", args=(0, 1 / RATE)).pvalue > 0.001

    # equal to the single-process run of the same seed, within the timing tolerance
    ref = single.by_id()
    assert set(ref) == set(recs)
    timed = run.timed and single.timed
    for rid, r in recs.items():
        s = ref[rid]
        assert (r.workload_class, r.session_id, r.turn) == (s.workload_class, s.session_id, s.turn)
        assert (r.input_tokens, r.output_tokens) == (s.input_tokens, s.output_tokens)
        if r.turn == 0 and timed:
            d = (r.actual_send - start) - (s.actual_send - single.stage["start"])
            assert abs(d) <= SEND_TOLERANCE_S
    if timed:
        ttft = median(r.ttft for r in run.records)
        assert abs(ttft - median(s.ttft for s in single.records)) <= 0.01

    # the manifest: clocks, the error budget, concurrency over time, each worker's verdict
    assert len(run.dist["workers"]) == 2
    for w in run.dist["workers"]:
        c = w["clock"]
        assert c["same_host"] and abs(c["offset_s"]) <= c["uncertainty_s"]
        assert c["applied_offset_s"] == 0.0
        assert w["client"]["loop_lag_s"]["n"] > 0 and w["recorded"] == w["assigned"] > 0
        assert w["client"]["valid"] or not run.timed  # valid only if every worker was
    budget = run.manifest["timing_error_budget_s"]
    assert budget["clock_offset_uncertainty_s"] == 0.0
    assert budget["across_workers_s"] >= budget["within_one_worker_s"] > 0
    conc = run.dist["concurrency"]
    assert conc["max"] >= 1 and 0 < conc["mean"] <= conc["max"] and conc["series"]


def test_closed_loop_concurrency_is_divided(mode, server, spec_file, tokenizer_dir, tmp_path):
    load = LoadSpec(concurrency=3, requests=18)
    run = bench(server, spec_file, tokenizer_dir, tmp_path / "r", load, workers=2, **mode)
    plan = the_plan(spec_file, tokenizer_dir, load)
    run.assert_complete()
    assert sorted(run.by_id()) == sorted(p.request_id for p in plan)
    assert [w["concurrency"] for w in run.dist["workers"]] == [2, 1]
    # the workers' shares follow their concurrency: 12 and 6 sessions' worth
    assigned = [w["assigned"] for w in run.dist["workers"]]
    assert assigned[0] > assigned[1] > 0
    conc = run.dist["concurrency"]
    assert conc["target"] == 3 and conc["max"] <= 3 and conc["mean"] > 1.0


def test_closed_loop_bounded_by_time_is_fed_while_it_runs(
    mode, server, spec_file, tokenizer_dir, tmp_path
):
    load = LoadSpec(concurrency=4, duration=1.5)
    run = bench(server, spec_file, tokenizer_dir, tmp_path / "r", load, workers=2, **mode)
    run.assert_complete()
    recs = run.by_id()
    assert len(recs) == len(run.records) > 8 and all(r.ok for r in run.records)
    indexes = sorted(int(rid[1:]) for rid in recs)
    from servelab.modelcore.tokenizer import Tokenizer

    planned = list(
        itertools.islice(
            iter_plan(
                load_workload(str(spec_file)),
                load,
                SEED,
                tokenizer=Tokenizer.from_model(tokenizer_dir),
                max_model_len=MAX_MODEL_LEN,
            ),
            indexes[-1] + 1,
        )
    )
    for rid, r in recs.items():
        p = planned[int(rid[1:])]
        assert (r.workload_class, r.session_id, r.turn) == (
            p.tags.workload_class,
            p.tags.session_id,
            p.tags.turn,
        )
    # no session begins after the duration (its later turns may follow); the workers' send
    # times reach the driver's clock only within the run's own timing error budget
    slack = run.manifest["timing_error_budget_s"]["across_workers_s"]
    first_turns = max(r.actual_send for r in run.records if r.turn == 0)
    assert first_turns <= run.stage["start"] + 1.5 + slack
    assert all(w["recorded"] > 0 for w in run.dist["workers"])
    assert run.dist["concurrency"]["max"] <= 4
    seen = served_workers(server, run)
    for _, turns in itertools.groupby(sorted(recs), key=lambda rid: recs[rid].session_id or rid):
        assert len({seen[rid] for rid in turns}) == 1


def _kill(worker) -> None:
    if worker.kind == "ray":
        import ray

        ray.kill(worker.actor)
    else:
        os.kill(worker.proc.pid, signal.SIGKILL)


def test_a_killed_worker_leaves_an_incomplete_run_with_every_record(
    mode, server, spec_file, tokenizer_dir, tmp_path, monkeypatch
):
    run_stage = WorkerPool.run_stage

    async def killing(self, plan, load, *, on_record, **kw):
        seen = itertools.count(1)

        def record(rec):
            on_record(rec)
            if next(seen) == 10:  # mid-run: kill worker 1 for real
                _kill(self.workers[1])

        return await run_stage(self, plan, load, on_record=record, **kw)

    monkeypatch.setattr(WorkerPool, "run_stage", killing)
    load = LoadSpec(rate=RATE, requests=SESSIONS)
    run = bench(server, spec_file, tokenizer_dir, tmp_path / "r", load, workers=2, **mode)
    assert run.code == 3
    assert not run.manifest["valid"] and not run.manifest["complete"]
    assert "incomplete" in run.manifest["invalid_reason"]
    assert len(run.manifest["workers"]["lost"]) == 1

    plan = the_plan(spec_file, tokenizer_dir, load)
    recs = run.by_id()  # every line readable
    assert len(recs) == len(run.records) == len(plan)  # every planned request, once
    lost = [r for r in run.records if not r.ok]
    assert lost and all(r.error.startswith("worker_lost: worker 1") for r in lost)
    assert sum(r.ok for r in run.records) >= 10  # what was recorded before is kept
    info = run.dist["lost"]
    assert info["requests"] == len(lost)
    assert info["share"] == pytest.approx(len(lost) / len(plan))
    assert 0 < info["share"] < 1
    assert run.dist["workers"][1]["lost"] and run.dist["workers"][0]["lost"] is None
