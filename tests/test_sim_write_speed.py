"""The fast paths of `servelab sim`'s writing and summary, each against its plain version:
batched JSONL writes against a write per line, writing beside the summary against before
it, step dicts against the field-by-field comprehension, a burst's records against
``record_step`` of each step, the roofline's decode price against ``predict``, and the
summary's shortcuts against their definitions."""

from __future__ import annotations

import dataclasses
import gc
import math
from collections import deque

import numpy as np
import pytest

import servelab.rundir as rundir
import servelab.sim.run_writer as run_writer
from servelab.analyze import summary
from servelab.analyze.stats import describe
from servelab.engine.engine import LLMEngine
from servelab.engine.sampling_params import SamplingParams
from servelab.rundir import RunDir
from servelab.sim.costs.executor import VirtualClock
from servelab.sim.costs.roofline import Efficiency, RooflineCostModel
from servelab.sim.costs.work import decode_work
from servelab.sim.loop.simulation import SimRequest, SimResult, Simulation, step_dict
from servelab.sim.run_writer import write_run_dir
from servelab.sim.sim_target import roofline_target
from servelab.vocab import ClientRecord, RequestTags, StepRecord

FILES = ("requests.jsonl", "server.jsonl", "steps.jsonl")


def _run(n: int = 12) -> tuple[SimResult, Simulation]:
    target = roofline_target("h200", "llama-3.1-8b")
    reqs = [SimRequest(f"r{i}", 0.004 * i, [i + 1] * (30 + 7 * i), 3 + 5 * i) for i in range(n)]
    sim = Simulation(target.factory, reqs)
    return sim.run(), sim


def _plain_dir(path, res: SimResult) -> None:
    """The run's JSONL files as the benchmark writes them: one encode and write per line."""
    out = RunDir(path)
    try:
        for r in res.records:
            out.add_record(r)
        for t in res.timelines:
            out.add_timeline(t.to_dict())
        for s in res.steps:
            out.add_step(s)
    finally:
        out.close()


def test_a_simulated_run_dir_holds_the_bytes_of_a_write_per_line(tmp_path, monkeypatch):
    res, _ = _run()
    assert res.num_burst_steps and len(res.steps) > 7  # bursts and batches both exercised
    monkeypatch.setattr(rundir, "_BATCH", 7)  # several batches, the last one short
    write_run_dir(tmp_path / "fast", res, target={"model": "m"})
    _plain_dir(tmp_path / "plain", res)
    for name in FILES:
        fast = (tmp_path / "fast" / name).read_bytes()
        assert fast == (tmp_path / "plain" / name).read_bytes(), name
        assert fast.count(b"\n") == {"requests.jsonl": 12, "server.jsonl": 12}.get(
            name, len(res.steps)
        )


def test_writing_beside_the_summary_writes_what_writing_before_it_does(tmp_path):
    res, _ = _run()
    for overlap in (True, False):
        write_run_dir(tmp_path / str(overlap) / "run", res, target={"model": "m"}, overlap=overlap)
    for name in (*FILES, "metrics.json"):
        assert (tmp_path / "True" / "run" / name).read_bytes() == (
            tmp_path / "False" / "run" / name
        ).read_bytes(), name


def test_batched_writers_count_lines_and_make_no_file_for_nothing(tmp_path, monkeypatch):
    res, _ = _run(3)
    monkeypatch.setattr(rundir, "_BATCH", 2)
    out = RunDir(tmp_path)
    out.add_records(res.records)
    out.add_timelines([])
    out.add_steps([])
    assert out.requests.lines == 3
    out.close()
    assert not (tmp_path / "server.jsonl").exists() and not (tmp_path / "steps.jsonl").exists()


def test_step_dicts_are_the_records_fields_in_order(monkeypatch):
    kept: list[StepRecord] = []
    real, real_bulk = LLMEngine.record_step, LLMEngine.record_decode_steps

    def record_step(self, *a, **k):
        kept.append(real(self, *a, **k))
        return kept[-1]

    def record_decode_steps(self, *a, **k):
        kept.extend(real_bulk(self, *a, **k))
        return kept[-len(a[1]) :]

    monkeypatch.setattr(LLMEngine, "record_step", record_step)
    monkeypatch.setattr(LLMEngine, "record_decode_steps", record_decode_steps)
    res, _ = _run()
    fields = list(StepRecord.__dataclass_fields__)
    assert len(kept) == len(res.steps) == res.num_steps
    for rec, d in zip(kept, res.steps, strict=True):
        plain = {k: getattr(rec, k) for k in fields}
        assert d == plain and list(d) == fields
        assert d["decode"] is rec.decode  # shallow, as the comprehension is
    rec = dataclasses.replace(kept[0], step_id=99)
    assert step_dict(rec) == {k: getattr(rec, k) for k in fields}


def test_a_bursts_records_are_record_step_of_each_of_its_steps():
    engine, _ = roofline_target("h200", "llama-3.1-8b").factory(VirtualClock(), 0)
    engine.step_records = deque(maxlen=10)  # kept, as a server's engine keeps them
    engine.replica, engine.role = 3, "decode"
    for i in range(2):  # waiting: their count is on every record
        engine.add_request(f"w{i}", prompt_token_ids=[5] * 20, sampling_params=SamplingParams())
    starts, ends, decode, used = [1.0, 2.0, 3.5], [2.0, 3.5, 4.25], ["a", "b"], [5, 6, 8]
    bulk = engine.record_decode_steps(40, starts, ends, decode, used)
    plain = [
        engine.record_step(40 + i, s, e, {}, list(decode), u, [])
        for i, (s, e, u) in enumerate(zip(starts, ends, used, strict=True))
    ]
    assert bulk == plain and list(engine.step_records) == bulk + plain
    assert bulk[0].num_waiting == 2 and bulk[0].kv_blocks_total == engine.kv_cache.num_blocks
    for b, p in zip(bulk, plain, strict=True):
        assert b.__dict__ == p.__dict__ and list(b.__dict__) == list(p.__dict__)
        assert [type(v) for v in b.__dict__.values()] == [type(v) for v in p.__dict__.values()]
    lists = [r.decode for r in bulk] + [r.prefill for r in bulk] + [r.preempted for r in bulk]
    assert len({id(x) for x in lists + [decode]}) == len(lists) + 1  # each record its own


def test_a_step_sink_sees_every_kept_step_in_order():
    target = roofline_target("h200", "llama-3.1-8b")
    reqs = [SimRequest(f"r{i}", 0.004 * i, [i + 1] * 40, 20) for i in range(6)]
    seen: list[dict] = []
    res = Simulation(target.factory, reqs, step_sink=seen.append).run()
    assert res.num_burst_steps and seen == res.steps and len(seen) == res.num_steps


def test_writing_the_run_dir_pauses_the_cyclic_collector(tmp_path, monkeypatch):
    res, _ = _run(3)
    during: list[bool] = []
    real = run_writer.summarize

    def spy(*a, **k):
        during.append(gc.isenabled())
        return real(*a, **k)

    monkeypatch.setattr(run_writer, "summarize", spy)
    was = gc.isenabled()
    gc.enable()
    try:
        write_run_dir(tmp_path, res, target={"model": "m"})
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
    assert during == [False]


@pytest.mark.parametrize(
    ("tp", "dtype", "eff"),
    [(1, None, None), (2, None, None), (4, "fp8", Efficiency(0.4, 0.7, 3e-4, 2e-6, 1e-5, 3e-7))],
)
def test_the_decode_price_is_predict_of_its_work(tp, dtype, eff):
    model = roofline_target("h200", "llama-3.1-8b", tp=tp, dtype=dtype, efficiency=eff).cost_model
    assert isinstance(model, RooflineCostModel)
    rng = np.random.default_rng(tp)
    pairs = [(1, 0), (3, 1000), (64, 70_000), (257, 123_457)]
    pairs += [
        (int(n), int(c)) for n, c in zip(rng.integers(1, 1025, 200), rng.integers(0, 10**6, 200))
    ]
    for seqs, ctx in pairs:
        assert model.decode_time(seqs, ctx) == model.predict(decode_work(seqs, ctx))
        assert model.cost(decode_work(seqs, ctx)).time == model.predict(decode_work(seqs, ctx))


def test_the_summary_runs_on_ordinary_pages_and_restores_numpys_setting(monkeypatch):
    multiarray = np._core.multiarray
    res, _ = _run(4)
    seen: list[bool] = []
    real = summary.timeslices

    def spy(*a, **k):
        seen.append(multiarray._get_madvise_hugepage())
        return real(*a, **k)

    monkeypatch.setattr(summary, "timeslices", spy)
    was = multiarray._set_madvise_hugepage(True)
    try:
        got = summary.summarize(res.records, n_boot=20)
        assert multiarray._get_madvise_hugepage() is True
    finally:
        multiarray._set_madvise_hugepage(was)
    assert seen == [False]
    monkeypatch.setattr(summary, "timeslices", real)
    assert summary.summarize(res.records, n_boot=20) == got


def test_describe_without_non_finite_values_copies_nothing_and_agrees():
    rng = np.random.default_rng(3)
    v = rng.lognormal(size=5000)
    g = np.sort(rng.integers(0, 800, v.size))
    with_nan = np.append(v, [math.nan, math.inf])
    g_nan = np.append(g, [g[-1], g[-1]])
    assert describe(v, g).to_dict() == describe(with_nan, g_nan).to_dict()
    assert describe(v[:500], g[:500], n_boot=50).to_dict() == (
        describe(np.append(v[:500], math.nan), np.append(g[:500], 0), n_boot=50).to_dict()
    )


def _record(chunk_times: list[float], chunk_tokens: list[int], output_tokens: int):
    rec = ClientRecord.for_request(
        "r",
        RequestTags(),
        stage=None,
        intended_send=0.0,
        actual_send=0.0,
        input_tokens=10,
        requested_output_tokens=output_tokens,
    )
    rec.chunk_times, rec.chunk_tokens, rec.output_tokens = chunk_times, chunk_tokens, output_tokens
    rec.done = chunk_times[-1] if chunk_times else None
    return rec


@pytest.mark.parametrize(
    ("times", "tokens", "out"),
    [
        ([1.0, 2.0, 3.0], [1, 2, 1], 4),  # every chunk inside
        ([0.5, 2.0, 3.0, 9.0], [1, 1, 3, 1], 6),  # the first and last outside
        ([1.0, 2.0], [0, 0], 2),  # chunks carrying no counted tokens
        ([1.0, 2.0, 3.0], [1, 1], 3),  # counts missing: chunks stand for tokens
    ],
)
def test_output_tokens_in_the_window_follow_the_definition(times, tokens, out):
    window = summary.Window(start=1.0, end=5.0)
    rec = _record(times, tokens, out)
    inside = [i for i, t in enumerate(times) if window.contains(t)]
    if len(tokens) == len(times):
        carried = sum(tokens) or len(times)
        counted = sum(tokens[i] for i in inside)
    else:
        carried, counted = len(times), len(inside)
    want = counted * (out / carried) if inside else 0.0
    assert summary._tokens_in_window(rec, window) == want


def test_synthetic_ids_are_the_unique_head_then_the_filler():
    from servelab.sim.loop.sim_requests import _FILLER, _unique_head, synthetic_ids

    for key in (0, 1, 29_999, 30_000, 10**9 + 7):
        for n in (0, 1, 2, 3, 4, 1155):
            head = _unique_head(key)[:n]
            assert synthetic_ids(key, n) == head + [_FILLER] * (n - len(head))
