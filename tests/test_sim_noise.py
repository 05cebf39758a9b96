"""Step-time noise and engine overhead measured from real runs, and replayed by the simulator."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from servelab.bench.workloads.request_plan import LoadSpec
from servelab.engine.engine_config import EngineConfig
from servelab.rundir import load_run
from servelab.sim.costs.drift import MIN_ANCHORS, is_anchor, run_speeds
from servelab.sim.costs.noise import StepNoise
from servelab.sim.costs.profiled import ProfileSample, ProfileTable
from servelab.sim.costs.work import StepWork
from servelab.sim.fit.recorded_steps import measured_steps
from servelab.sim.fit.run_profile import fit_overhead, table_from_runs
from servelab.sim.run_writer import write_run_dir
from servelab.sim.scenario import Scenario, load_requests, simulate
from servelab.sim.sim_target import profile_target


def _ar1_logs(n: int, phi: float, sd: float, rng: random.Random) -> list[float]:
    z, out = rng.gauss(0, 1), []
    for _ in range(n):
        z = phi * z + math.sqrt(1 - phi * phi) * rng.gauss(0, 1)
        out.append(sd * z)
    return out


def _lag1(xs: list[float]) -> float:
    m = statistics.fmean(xs)
    num = sum((a - m) * (b - m) for a, b in itertools.pairwise(xs))
    return num / sum((x - m) ** 2 for x in xs)


def test_step_noise_measures_spread_and_correlation_and_replays_them():
    rng = random.Random(3)
    runs = [[math.exp(x) for x in _ar1_logs(600, 0.7, 0.1, rng)] for _ in range(3)]
    noise = StepNoise.measure(runs)
    assert noise is not None and noise.steps == 1800
    q = noise.log_quantiles
    # The quartiles of N(0, 0.1) are at -/+0.0674 (quantiles 25 and 75 of 0..100 sit at
    # 25.25% and 74.75%).
    assert q[25] == pytest.approx(-0.0674, abs=0.015) and q[75] == pytest.approx(0.0674, abs=0.015)
    assert noise.autocorr == pytest.approx(0.7, abs=0.06)

    draw = noise.sampler(seed=0)
    logs = [math.log(draw()) for _ in range(20000)]
    assert statistics.pstdev(logs) == pytest.approx(0.1, rel=0.1)
    assert _lag1(logs) == pytest.approx(0.7, abs=0.05)
    # Never outside the stored quantiles: the 0.5% on each side are clipped to them.
    assert q[0] - 1e-12 <= min(logs) and max(logs) <= q[-1] + 1e-12

    again, other = noise.sampler(seed=0), noise.sampler(seed=1)
    first = [again() for _ in range(5)]
    assert first == [math.exp(x) for x in logs[:5]]
    assert first != [other() for _ in range(5)]
    assert StepNoise.from_dict(noise.to_dict()) == noise


def test_step_noise_needs_enough_steps():
    assert StepNoise.measure([[1.0] * 10, [1.1] * 9]) is None


def test_overhead_fit_takes_a_per_sequence_term_and_falls_back_to_the_median():
    rows = [(s, 1e-3 + 5e-5 * s) for s in (1, 2, 4, 8, 12) for _ in range(3)]
    fit = fit_overhead(rows)
    assert fit["per_step"] == pytest.approx(1e-3) and fit["per_seq"] == pytest.approx(5e-5)
    falling = [(s, 2e-3 - 1e-4 * s) for s in (1, 2, 3, 4, 5)]
    fit = fit_overhead(falling)
    assert fit["per_seq"] == 0.0 and fit["per_step"] == pytest.approx(1.7e-3)
    assert fit_overhead([])["per_step"] == 0.0


def _table(noise: StepNoise | None) -> ProfileTable:
    samples = []
    for seqs in (1, 2, 4, 8, 16):
        w = StepWork()
        for _ in range(seqs):
            w.add(1, 200, 1)
        samples.append(ProfileSample(w, 0.02 + 0.004 * seqs))
    for n in (16, 64, 256, 1024):
        w = StepWork()
        w.add(n, 0, 1)
        samples.append(ProfileSample(w, 0.02 + 0.0004 * n))
    meta = {
        "engine_config": {"max_num_seqs": 16, "kv_cache_memory_gb": 0.05},
        "overhead": {"per_step": 1e-3, "per_seq": 0.0},
    }
    if noise is not None:
        meta["step_noise"] = noise.to_dict()
    return ProfileTable("smollm2-135m", "cpu", samples, meta)


def _itls(target, sim_seed: int = 0) -> tuple[list[float], object]:  # type: ignore[no-untyped-def]
    reqs, info, _ = load_requests(
        "chat", LoadSpec(rate=2.0, requests=40, length_scale=0.5), 0, 2048
    )
    res = simulate(Scenario(target, reqs, info=info, sim_seed=sim_seed))
    return [g for r in res.records for g in r.itls], res


def test_simulated_steps_vary_as_measured_and_stay_deterministic(tmp_path):
    rng = random.Random(5)
    noise = StepNoise.measure([[math.exp(x) for x in _ar1_logs(500, 0.6, 0.12, rng)]])
    assert noise is not None
    plain, _ = _itls(profile_target(_table(None)))
    target = profile_target(_table(noise))
    noisy, res = _itls(target)
    again, _ = _itls(profile_target(_table(noise)))
    assert noisy == again  # seeded per replica
    other, _ = _itls(profile_target(_table(noise)), sim_seed=1)
    assert other != noisy and other == _itls(profile_target(_table(noise)), sim_seed=1)[0]
    # The typical step time is unchanged.
    assert statistics.fmean(noisy) == pytest.approx(statistics.fmean(plain), rel=0.05)

    # Each step strays from the cost model as measured, and alike its neighbour.
    run = write_run_dir(tmp_path / "run", res, target=target.describe(), n_boot=0)
    steps = measured_steps(load_run(run))
    logs = [math.log(m.duration / target.cost_model.predict(m.work)) for m in steps]
    assert statistics.pstdev(logs) == pytest.approx(0.12, rel=0.2)
    assert _lag1(logs) == pytest.approx(0.6, abs=0.1)
    # And a profile made from that run measures about the same noise back.
    table = table_from_runs([str(run)], "smollm2-135m")
    back = StepNoise.from_dict(table.meta["step_noise"])
    assert back.log_quantiles[75] - back.log_quantiles[25] == pytest.approx(
        noise.log_quantiles[75] - noise.log_quantiles[25], rel=0.2
    )
    # The simulator's steps are back to back (its overhead is inside each step).
    assert table.meta["overhead"]["per_step"] == pytest.approx(0.0, abs=1e-9)
    assert EngineConfig(**table.meta["engine_config"]).max_num_seqs == 16


def test_resend_divergence_is_drawn_per_request_and_measured_back(tmp_path):
    import dataclasses

    from servelab.sim.loop import history
    from servelab.sim.sim_target import roofline_target

    hazard = history.Resend(per_token=0.01)
    draws = [hazard.cut(f"r{i}") for i in range(4000)]
    assert statistics.fmean(draws) == pytest.approx(99, rel=0.1)  # geometric: (1 - p) / p
    assert draws[:50] == [hazard.cut(f"r{i}") for i in range(50)]
    assert history.Resend().cut("r0") == math.inf
    starts = [history.Resend(at_start=0.25).cut(f"r{i}") for i in range(4000)]
    assert starts.count(0) / 4000 == pytest.approx(0.25, abs=0.03)
    assert set(starts) == {0, math.inf}

    target = roofline_target("h200", "llama-3.1-8b", engine_config=EngineConfig(max_num_seqs=64))
    load = LoadSpec(rate=4.0, requests=80)
    measured = {}
    for r in (history.Resend(), history.Resend(0.004), history.Resend(0.004, 0.2)):
        reqs, _, _ = load_requests("agent", load, 0, 8192, resend=r)
        t = dataclasses.replace(target, resend=r)
        res = simulate(Scenario(t, reqs))
        run = write_run_dir(
            tmp_path / f"p{r.per_token}-{r.at_start}", res, target=t.describe(), n_boot=0
        )
        measured[r] = history.measure([load_run(run)])
    exact, lossy, both = measured.values()
    assert exact is not None and exact["turns"] > 100 and exact["diverged"] == 0
    assert lossy is not None and lossy["diverged"] > 50
    assert lossy["per_token"] == pytest.approx(0.004, rel=0.25)
    # Divergences in the answer's first block count at the start: a hazard puts few there.
    assert lossy["at_start"] < 0.08
    assert both is not None and both["at_start"] == pytest.approx(0.2, abs=0.08)
    assert both["per_token"] == pytest.approx(0.004, rel=0.3)


def test_a_profile_records_how_far_its_runs_speeds_differed(tmp_path):
    # Two runs of the same cost model, the second on a machine 25% slower throughout.
    runs, durations = [], []
    for i, speed in enumerate((1.0, 1.25)):
        table = _table(None)
        for s in table.samples:
            s.time *= speed
        table.meta["overhead"]["per_step"] *= speed
        target = profile_target(table)
        reqs, info, _ = load_requests(
            "chat", LoadSpec(rate=0.5, requests=20, length_scale=0.5), i, 2048
        )
        res = simulate(Scenario(target, reqs, info=info))
        run = write_run_dir(tmp_path / f"run{i}", res, target=target.describe(), n_boot=0)
        runs.append(str(run))
        durations += [m.duration for m in measured_steps(load_run(run))]
    table = table_from_runs(runs, "smollm2-135m")
    fast, slow = table.meta["run_speeds"]
    assert slow / fast == pytest.approx(1.25, rel=0.02)
    assert fast * slow == pytest.approx(1.0)  # relative to the runs' geometric mean
    assert [s.time for s in table.samples] == durations  # recorded, not divided out
    # One run has nothing to compare with.
    assert "run_speeds" not in table_from_runs(runs[:1], "smollm2-135m").meta
    # The CLI says how far apart they were.
    from typer.testing import CliRunner

    from servelab.cli import app

    args = ["profile", "--from-run", runs[0], "--from-run", runs[1], "--out", f"{tmp_path}/p.json"]
    r = CliRunner().invoke(app, [*args, "--model", "smollm2-135m"])
    assert r.exit_code == 0, r.output
    assert f"{fast:.2f}, {slow:.2f} of their mean" in r.output


def test_a_profile_from_runs_records_the_weights_mode_and_refuses_a_mix(tmp_path):
    import json

    target = profile_target(_table(None))
    reqs, info, _ = load_requests("chat", LoadSpec(rate=0.5, requests=8, length_scale=0.5), 0, 2048)
    res = simulate(Scenario(target, reqs, info=info))
    runs = []
    for mode in ("q4_1", "q4_1", "none"):
        run = write_run_dir(tmp_path / f"run{len(runs)}", res, target=target.describe(), n_boot=0)
        manifest = json.loads((run / "manifest.json").read_text())
        manifest["server"]["quantization"] = mode  # as a real server's /version reports it
        (run / "manifest.json").write_text(json.dumps(manifest))
        runs.append(str(run))
    table = table_from_runs(runs[:2], "smollm2-135m")
    assert table.meta["quantization"] == "q4_1"
    assert profile_target(table).describe()["quantization"] == "q4_1"
    with pytest.raises(ValueError, match="one weight mode at a time"):
        table_from_runs(runs, "smollm2-135m")
    # The CLI: a mode the server does not offer, or one given beside runs that carry theirs.
    from typer.testing import CliRunner

    from servelab.cli import app

    bad = CliRunner().invoke(app, ["profile", "--quantization", "q9"])
    assert bad.exit_code != 0 and "use none, bf16, q4_1" in bad.output
    both = CliRunner().invoke(app, ["profile", "--from-run", runs[0], "--quantization", "q4_1"])
    assert both.exit_code != 0 and "drop --quantization" in both.output


def test_run_speeds_need_anchors_in_every_run():
    anchor, batch = StepWork(), StepWork()
    anchor.add(1, 300, 1)
    for _ in range(4):
        batch.add(1, 300, 1)
    assert is_anchor(anchor) and not is_anchor(batch)

    def flat(w):
        return 0.03

    runs = [
        [ProfileSample(anchor, 0.03)] * MIN_ANCHORS,
        [ProfileSample(anchor, 0.036)] * MIN_ANCHORS,
    ]
    speeds = run_speeds(runs, flat)
    assert speeds is not None and speeds[1] / speeds[0] == pytest.approx(1.2)
    assert run_speeds([runs[0], [ProfileSample(batch, 0.05)] * 100], flat) is None
