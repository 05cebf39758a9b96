"""The max-rate search brackets the limit, then bisects, and never repeats a rate."""

from __future__ import annotations

import asyncio

import pytest

from servelab.bench.search import find_max_rate, saturated, sweep_stop


def _search(limit: float, start: float, steps: int = 3, stop_after: int | None = None):
    tried: list[float] = []

    async def trial(rate: float):
        if stop_after is not None and len(tried) >= stop_after:
            return None
        tried.append(rate)
        return rate <= limit

    return asyncio.run(find_max_rate(trial, start, steps)), tried


def test_grows_then_bisects():
    res, tried = _search(limit=5.0, start=1.0)
    assert tried[:4] == [1.0, 2.0, 4.0, 8.0]
    assert len(tried) == 4 + 3 and len(set(tried)) == len(tried)
    assert 4.0 <= res.max_rate <= 5.0 < res.lowest_failing <= 8.0
    assert res.lowest_failing / res.max_rate < 2 ** (1 / 8) + 1e-9  # three halvings of log-width


def test_shrinks_when_the_start_fails():
    res, tried = _search(limit=0.3, start=1.0, steps=0)
    assert tried == [1.0, 0.5, 0.25]
    assert res.max_rate == 0.25 and res.lowest_failing == 0.5


def test_nothing_passes_and_interruption():
    res, tried = _search(limit=0.0, start=1.0)
    assert res.max_rate is None and len(tried) == 9
    res, tried = _search(limit=5.0, start=1.0, stop_after=2)
    assert tried == [1.0, 2.0] and res.max_rate == pytest.approx(2.0)


def _body(state: str) -> dict:
    return {"timeslices": {"saturation": {"state": state}}}


def test_a_sweep_stops_raising_the_load_at_an_over_saturated_stage():
    rates = [1.0, 2.0, 4.0, 8.0]
    assert sweep_stop("rate", rates, 1, _body("steady")) == ""
    assert sweep_stop("rate", rates, 1, _body("undetermined")) == ""
    why = sweep_stop("rate", rates, 1, _body("over_saturated"))
    assert "rate=2 never reached a steady state" in why and "4, 8 were not run" in why
    assert sweep_stop("rate", rates, 3, _body("over_saturated")) == ""  # nothing left
    assert sweep_stop("rate", [8.0, 1.0], 0, _body("over_saturated")) == ""  # load goes down
    assert saturated(_body("over_saturated")) and not saturated(None)
