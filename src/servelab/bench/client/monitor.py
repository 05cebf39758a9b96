"""The client watches itself: event-loop lag and its own CPU, and says when it was the bottleneck.

A ticker coroutine asks to wake every ``period`` seconds and records how late it
woke. A late wake-up means a ready socket waited just as long before it was read: with
user-space stamps its chunk was stamped that late; with kernel receive stamps, chunks
that arrived during the wait share one read and its (last) stamp. Either way the lag
bounds the client's own timing error. The CPU the process used over the run
(``resource.getrusage``) says whether it was busy.
"""

from __future__ import annotations

import asyncio
import resource
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servelab.vocab import ClientRecord

# A run is not valid when the client itself may have distorted what it measured.
MAX_LOOP_LAG_P99_S = 0.005  # event-loop lag p99 (the timing error it allows)
MAX_CPU_UTILISATION = 0.90  # of one core, over the whole run
MAX_SEND_LAG_P99_S = 0.050  # open loop: requests sent this late behind their schedule


@dataclass
class ClientHealth:
    """What the monitor saw, and the verdict."""

    loop_lag: dict[str, float | None] = field(default_factory=dict)
    cpu_seconds: float = 0.0
    wall_seconds: float = 0.0
    cpu_utilisation: float = 0.0
    send_lag: dict[str, float | None] = field(default_factory=dict)
    valid: bool = True
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "loop_lag_s": self.loop_lag,
            "cpu_seconds": self.cpu_seconds,
            "wall_seconds": self.wall_seconds,
            "cpu_utilisation": self.cpu_utilisation,
            "send_lag_s": self.send_lag,
            "valid": self.valid,
            "reasons": self.reasons,
            "thresholds": {
                "loop_lag_p99_s": MAX_LOOP_LAG_P99_S,
                "cpu_utilisation": MAX_CPU_UTILISATION,
                "send_lag_p99_s": MAX_SEND_LAG_P99_S,
            },
        }


def _dist(x: list[float]) -> dict[str, float | None]:
    if not x:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    a = np.asarray(x)
    return {
        "n": int(a.size),
        "p50": float(np.percentile(a, 50)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
    }


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class LoopMonitor:
    """``start()`` inside the running loop, ``stop()`` then ``report(records)``."""

    def __init__(self, period: float = 0.01) -> None:
        self.period = period
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None
        self._t0 = self._c0 = 0.0
        self._t1 = self._c1 = 0.0

    def start(self) -> None:
        self._t0, self._c0 = time.monotonic(), _cpu()
        self._task = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        while True:
            due = time.monotonic() + self.period
            await asyncio.sleep(self.period)
            self.lags.append(max(0.0, time.monotonic() - due))

    async def stop(self) -> None:
        self._t1, self._c1 = time.monotonic(), _cpu()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def report(self, records: list[ClientRecord], open_loop: bool) -> ClientHealth:
        wall = max(1e-9, self._t1 - self._t0)
        h = ClientHealth(
            loop_lag=_dist(self.lags),
            cpu_seconds=self._c1 - self._c0,
            wall_seconds=wall,
            cpu_utilisation=(self._c1 - self._c0) / wall,
            send_lag=_dist([r.send_lag for r in records if r.turn == 0]) if open_loop else {},
        )
        p99 = h.loop_lag.get("p99")
        if p99 is not None and p99 > MAX_LOOP_LAG_P99_S:
            h.reasons.append(
                f"client event-loop lag p99 {p99 * 1e3:.1f} ms > {MAX_LOOP_LAG_P99_S * 1e3:.0f} ms: "
                "the client fell behind, so chunk times may be off by that much"
            )
        if h.cpu_utilisation > MAX_CPU_UTILISATION:
            h.reasons.append(
                f"client CPU {h.cpu_utilisation:.0%} of a core > {MAX_CPU_UTILISATION:.0%}: "
                "the client was busy"
            )
        sp99 = h.send_lag.get("p99") if open_loop else None
        if sp99 is not None and sp99 > MAX_SEND_LAG_P99_S:
            h.reasons.append(
                f"requests went out {sp99 * 1e3:.0f} ms (p99) behind the arrival schedule: "
                "the client could not keep the rate"
            )
        h.valid = not h.reasons
        return h
