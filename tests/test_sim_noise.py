"""Step-time noise and engine overhead measured from real runs, and replayed by the simulator."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from servelab.bench.plan import LoadSpec
from servelab.engine.config import EngineConfig
from servelab.sim.noise import StepNoise
from servelab.sim.profiled import ProfileSample, ProfileTable
from servelab.sim.profiler import fit_overhead, table_from_runs
from servelab.sim.rundir import write_run_dir
from servelab.sim.scenario import Scenario, load_requests, simulate
from servelab.sim.target import profile_target
from servelab.sim.work import StepWork


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
    # The quartiles of N(0, 0.1) are at -/+0.0674; quantile 10 of 40 is 25%.
    assert q[10] == pytest.approx(-0.0674, abs=0.015) and q[30] == pytest.approx(0.0674, abs=0.015)
    assert noise.autocorr == pytest.approx(0.7, abs=0.06)

    draw = noise.sampler(seed=0)
    logs = [math.log(draw()) for _ in range(20000)]
    assert statistics.pstdev(logs) == pytest.approx(0.1, rel=0.1)
    assert _lag1(logs) == pytest.approx(0.7, abs=0.05)
    assert min(logs) >= q[0] and max(logs) <= q[-1]  # never outside what was measured

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


def _itls(target) -> tuple[list[float], object]:  # type: ignore[no-untyped-def]
    reqs, info, _ = load_requests(
        "chat", LoadSpec(rate=2.0, requests=40, length_scale=0.5), 0, 2048
    )
    res = simulate(Scenario(target, reqs, info=info))
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
    # The typical step time is unchanged; the spread is the measured one.
    assert statistics.fmean(noisy) == pytest.approx(statistics.fmean(plain), rel=0.05)
    q = statistics.quantiles
    spread = q(noisy, n=20)[17] / q(noisy, n=20)[1]
    assert spread > 1.2 * (q(plain, n=20)[17] / q(plain, n=20)[1])

    # A run directory of the noisy simulation measures back to about the same noise.
    run = write_run_dir(tmp_path / "run", res, target=target.describe(), n_boot=0)
    table = table_from_runs([str(run)], "smollm2-135m")
    back = StepNoise.from_dict(table.meta["step_noise"])
    assert back.log_quantiles[30] - back.log_quantiles[10] == pytest.approx(
        noise.log_quantiles[30] - noise.log_quantiles[10], rel=0.3
    )
    # The simulator's steps are back to back (its overhead is inside each step).
    assert table.meta["overhead"]["per_step"] == pytest.approx(0.0, abs=1e-9)
    assert EngineConfig(**table.meta["engine_config"]).max_num_seqs == 16
