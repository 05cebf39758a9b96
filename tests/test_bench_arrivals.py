"""Arrival processes have the statistics they claim."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from servelab.bench.workloads.arrivals import arrival_times


def _take(kind: str, rate: float, n: int, seed: int = 0, **kw) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.array(list(itertools.islice(arrival_times(kind, rate, rng, **kw), n)))


def test_poisson_rate_and_cv():
    t = _take("poisson", 5.0, 20000)
    gaps = np.diff(t)
    assert t[0] == 0.0
    assert 1 / gaps.mean() == pytest.approx(5.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)
    # counts in 1 s windows: Poisson, so variance == mean
    counts = np.bincount(t.astype(int))[:-1]
    assert counts.var() / counts.mean() == pytest.approx(1.0, rel=0.1)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_cv_is_one_over_sqrt_burstiness(burstiness):
    gaps = np.diff(_take("gamma", 2.0, 20000, burstiness=burstiness))
    assert 1 / gaps.mean() == pytest.approx(2.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_constant_and_infinite_rate():
    assert np.allclose(np.diff(_take("constant", 4.0, 100)), 0.25)
    assert np.all(_take("poisson", math.inf, 50) == 0.0)


def test_on_off_bursts_are_silent_when_off():
    t = _take("onoff", 10.0, 5000, on=2.0, off=3.0)
    phase = np.mod(t, 5.0)
    assert np.all(phase <= 2.0)
    # the rate during on-periods is the given rate
    assert len(t) / ((t[-1] // 5.0) * 2.0 + min(phase[-1], 2.0)) == pytest.approx(10.0, rel=0.05)


def test_ramp_rate_grows_linearly():
    t = _take("ramp", 1.0, 20000, ramp_to=9.0, ramp_over=100.0)
    first, last = np.sum(t < 10), np.sum((t >= 90) & (t < 100))
    # expected counts: integral of 1 + 0.08 t over [0,10] = 14, over [90,100] = 86
    assert first == pytest.approx(14, abs=4 * math.sqrt(14))
    assert last == pytest.approx(86, abs=4 * math.sqrt(86))
    after = np.sum((t >= 200) & (t < 300))
    assert after == pytest.approx(900, rel=0.1)


def test_bad_arrival_parameters():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="unknown arrival"):
        arrival_times("weibull", 1.0, rng)
    with pytest.raises(ValueError, match="rate must be > 0"):
        arrival_times("poisson", 0.0, rng)
    with pytest.raises(ValueError, match="--on-off"):
        arrival_times("onoff", 1.0, rng, on=0.0, off=1.0)
    with pytest.raises(ValueError, match="--ramp-to"):
        arrival_times("ramp", 1.0, rng)
