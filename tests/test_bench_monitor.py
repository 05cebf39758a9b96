"""The client's self-check: a blocked event loop or a missed schedule makes a run invalid."""

from __future__ import annotations

import asyncio
import time

from servelab.bench.client.monitor import MAX_LOOP_LAG_P99_S, LoopMonitor
from servelab.vocab import ClientRecord


def _watch(block_s: float) -> LoopMonitor:
    async def go() -> LoopMonitor:
        mon = LoopMonitor(period=0.005)
        mon.start()
        for _ in range(20):
            await asyncio.sleep(0.01)
            time.sleep(block_s)  # noqa: ASYNC251 -- the client blocking its own loop
        await mon.stop()
        return mon

    return asyncio.run(go())


def test_a_blocked_loop_makes_the_run_invalid():
    busy = _watch(4 * MAX_LOOP_LAG_P99_S).report([], open_loop=False)
    assert not busy.valid
    assert any("event-loop lag" in r for r in busy.reasons)
    assert busy.loop_lag["p99"] > MAX_LOOP_LAG_P99_S
    idle = _watch(0.0)
    assert idle.lags and sorted(idle.lags)[len(idle.lags) // 2] < busy.loop_lag["p99"]


def test_sends_behind_schedule_make_an_open_loop_run_invalid():
    late = [
        ClientRecord(request_id=f"r{i}", workload_class="c", intended_send=i, actual_send=i + 0.2)
        for i in range(10)
    ]
    mon = _watch(0.0)
    h = mon.report(late, open_loop=True)
    assert any("behind the arrival schedule" in r for r in h.reasons) and not h.valid
    assert h.send_lag["p99"] > 0.19
    assert not any("schedule" in r for r in mon.report(late, open_loop=False).reasons)
