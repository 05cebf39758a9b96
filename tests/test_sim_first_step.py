"""How much of a burst an idle server's first step takes: read off a run's client records
(``sim.fit.first_step``), held by a twin, and replayed by the simulation loop."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import rundirs
from rich.console import Console

from servelab.engine.engine_config import EngineConfig
from servelab.report.twin_tables import calibration_table
from servelab.rundir import load_run
from servelab.sim.costs.serving_path import ServingPath
from servelab.sim.fit.first_step import first_step, first_steps
from servelab.sim.fit.twin import TwinCalibration, calibrate_runs
from servelab.sim.loop.simulation import SimRequest
from servelab.sim.scenario import Scenario, simulate
from servelab.sim.sim_target import roofline_target

GOLDEN = Path(__file__).parent / "data" / "twin" / "calm-vllm-twin.json"


def _rec(send: float, ttft: float | None, prompt: int = 100, ok: bool = True):
    return SimpleNamespace(actual_send=send, ttft=ttft, input_tokens=prompt, ok=ok)


def test_a_runs_first_step_is_the_part_of_its_opening_burst_it_took():
    # vLLM-CPU as measured: one request alone, the other three a step later
    run = [_rec(0.0, 0.12), _rec(0.001, 0.39), _rec(0.001, 0.39), _rec(0.002, 0.39)]
    assert first_step(run, 2048, 128) == pytest.approx([100, 0.25])
    # llama-server: two and two; later requests are not the burst
    run = [_rec(0.0, 1.53, 300), _rec(0.0, 1.531), _rec(0.0, 4.07), _rec(0.0, 4.07), _rec(3.0, 1)]
    assert first_step(run, 2048, 4) == pytest.approx([150, 0.5])
    # a failed request, no burst: no share
    assert first_step([_rec(0.0, 0.1), _rec(0.0, None, ok=False)], 2048, 4) is None
    assert first_step([_rec(0.0, 0.1), _rec(1.0, 0.1)], 2048, 4) is None


def test_a_full_first_step_says_nothing_and_a_capped_one_took_all_it_could():
    run = [_rec(0.0, 1.0, 800), _rec(0.0, 1.0, 800), _rec(0.0, 2.0, 700), _rec(0.0, 2.0, 600)]
    assert first_step(run, 2048, 4) is None  # 1600 taken: the 600 would not have fitted
    assert first_step(run, 2200, 4) == pytest.approx([725, 0.5])  # it would have
    assert first_step(run, None, 4) is None  # no budget known: no telling
    # eight sent to four slots, four in the first step: all the engine could hold
    eight = [_rec(0.0, 1.0, 64)] * 4 + [_rec(0.0, 2.0, 64)] * 4
    assert first_step(eight, 2048, 4) == pytest.approx([64, 1.0])
    assert first_step(eight, 2048, 128) == pytest.approx([64, 0.5])


def test_a_twin_keeps_each_runs_first_step_by_prompt_length():
    quarter = [_rec(0.0, 0.1, 400), _rec(0.0, 0.3, 400), _rec(0.0, 0.3), _rec(0.0, 0.3)]
    half = [_rec(0.0, 0.1), _rec(0.0, 0.1), _rec(0.0, 0.3), _rec(0.0, 0.3)]
    single = [_rec(0.0, 0.1)]
    assert first_steps([quarter, half, single], 2048, 4) == [[100, 0.5], [250, 0.25]]
    assert first_steps([single], 2048, 4) is None


def test_the_first_step_takes_the_share_of_the_bursts_nearest_in_length():
    path = ServingPath(first_steps=((64, 1.0), (64, 1.0), (180, 0.5), (180, 1.0), (200, 0.75)))
    assert path.share_for(60) == 1.0  # the 64-token bursts
    assert path.share_for(700) == 0.75  # 180 is nearest; 200 is within 1.5x of it
    assert path.share_for(100) == 1.0  # 64 is nearer than 180
    assert [path.first_step(n, 700) for n in (1, 2, 4)] == [1, 2, 3]
    assert path.first_step(8, 700, slots=4) == 3  # of what the engine can hold
    quarter = ServingPath(first_steps=((100, 0.25),))
    assert [quarter.first_step(n, 5000) for n in (1, 2, 4, 8)] == [1, 1, 1, 2]
    assert ServingPath().first_step(8, 100) == 8
    with pytest.raises(ValueError, match="share"):
        ServingPath(first_steps=((100, 0.0),))


def _burst(n: int, prompt: int = 200, out: int = 8) -> list[SimRequest]:
    return [
        SimRequest(f"r{i}", 0.0, [100 + i * 1000 + j for j in range(prompt)], out) for i in range(n)
    ]


def _firsts(path: ServingPath | None, reqs: list[SimRequest]) -> list[float]:
    target = roofline_target(
        "h100", "llama-3.1-8b", engine_config=EngineConfig(max_num_seqs=8, block_size=16)
    )
    target = dataclasses.replace(target, serving_path=path)
    res = simulate(Scenario(target=target, requests=reqs))
    return sorted(r.chunk_times[0] for r in res.records)


def test_an_idle_engine_starts_on_its_share_and_the_rest_join_the_next_step():
    whole = _firsts(None, _burst(4))
    assert len(set(whole)) == 1  # the whole burst prefilled in one step
    assert _firsts(ServingPath(), _burst(4)) == whole  # a share of 1 changes nothing
    part = _firsts(ServingPath(first_steps=((200, 0.25),)), _burst(4))
    assert part[0] < whole[0]  # the first request's prefill alone is shorter
    assert part[0] < part[1] == part[2] == part[3]  # the other three: the next step
    halves = _firsts(ServingPath(first_steps=((200, 0.5),)), _burst(4))
    assert halves[0] == halves[1] < halves[2] == halves[3]


def test_a_busy_engine_takes_a_burst_at_its_next_step_as_before():
    # r0 alone first; the burst of three arrives while its step runs
    reqs = [SimRequest("r0", 0.0, list(range(100, 300)), 8)]
    reqs += [
        SimRequest(f"r{i}", 1e-4, [100 + i * 1000 + j for j in range(200)], 8) for i in (1, 2, 3)
    ]
    assert _firsts(ServingPath(first_steps=((200, 0.25),)), reqs) == _firsts(None, reqs)


def test_a_twin_reads_its_share_off_its_runs_and_its_serving_path_replays_it(tmp_path):
    # servelab's own engine (a planted run) takes a whole burst into its first step
    reqs = [rundirs.Req(f"b{k}", "chat", 0.0, 120, 20) for k in range(4)]
    reqs += rundirs.chat_requests(30, 4.0, 1)[4:]
    run = rundirs.as_other_target(rundirs.write_run(tmp_path / "run", reqs), figures=True)
    cal = calibrate_runs([load_run(run)], "vllm serve m", "cpu")
    assert cal.first_steps == [[120, 1.0]]
    assert cal.target().serving_path is None  # the whole burst at once, as before
    vllm_like = dataclasses.replace(cal, first_steps=[[120, 0.25]])
    path = vllm_like.target(draw=2).serving_path
    assert path is not None and path.first_steps == ((120, 0.25),)
    assert path.first_step(4, 300) == 1
    again = TwinCalibration.load(vllm_like.save(tmp_path / "twin.json"))
    assert again.first_steps == [[120, 0.25]]


def test_a_twin_file_with_one_share_for_every_burst_loads_as_one_length(tmp_path):
    doc = json.loads(GOLDEN.read_text())
    doc.pop("first_steps")
    doc.update({"format": "servelab-twin/1", "burst_share": 0.25, "run": "old"})
    (tmp_path / "old.json").write_text(json.dumps(doc))
    old = TwinCalibration.load(tmp_path / "old.json")
    assert old.first_steps == [[1.0, 0.25]]
    path = old.target().serving_path
    assert path is not None and path.first_step(4, 800) == 1


def test_the_calibration_table_states_each_lengths_first_steps_once():
    doc = json.loads(GOLDEN.read_text())
    doc["first_steps"] = [[64.0, 1.0], [64.0, 1.0], [178.75, 0.25], [178.75, 0.5]]
    console = Console(file=io.StringIO(), width=400)
    console.print(calibration_table(doc))
    printed = " ".join(console.file.getvalue().split())
    assert "100%/100% at 64; 25%/50% at 179 prompt tokens" in printed
