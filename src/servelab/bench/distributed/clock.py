"""Worker clocks against the driver's: an NTP-style ping exchange, and the timing error budget.

One sample: the driver reads its clock (``t0``), asks the worker for its
``time.monotonic()`` (``tw``) and reads its clock again when the answer is back (``t1``).
Wherever inside ``[t0, t1]`` the worker read its clock, ``tw - (t0 + t1) / 2`` is the
worker's offset to within half the round trip. Of several samples the one with the
shortest round trip gives the offset, and half its round trip is the uncertainty.

On one host ``CLOCK_MONOTONIC`` is a single kernel clock shared by every process (the
same boot id). A worker on the driver's host whose measured offset is zero within its
uncertainty therefore gets an applied offset of exactly 0 with no uncertainty (time
namespaces could shift it, which the measurement would show). Elsewhere the measured
offset is applied: ``driver time = worker time - applied offset``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PING_SAMPLES = 16


def boot_id() -> str | None:
    """This kernel's boot id (Linux); processes with the same one share ``CLOCK_MONOTONIC``."""
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return None


@dataclass
class ClockOffset:
    """One worker's clock against the driver's (seconds)."""

    offset_s: float  # measured: worker clock - driver clock
    uncertainty_s: float  # half the shortest round trip
    rtt_min_s: float
    samples: int
    same_host: bool  # same boot id as the driver
    applied_offset_s: float
    applied_uncertainty_s: float
    drift_s: float = 0.0  # change of the measured offset over the stage (set afterwards)

    def to_driver(self, t: float) -> float:
        return t - self.applied_offset_s

    def to_worker(self, t: float) -> float:
        return t + self.applied_offset_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def measure_offset(
    ping: Callable[[], Awaitable[tuple[float, str | None]]],
    samples: int = PING_SAMPLES,
    local_boot: str | None = None,
) -> ClockOffset:
    """Ping ``samples`` times; ``ping()`` returns the worker's monotonic time and boot id."""
    best: tuple[float, float] | None = None  # (round trip, offset)
    remote_boot: str | None = None
    for _ in range(samples):
        t0 = time.monotonic()
        tw, remote_boot = await ping()
        t1 = time.monotonic()
        rtt = t1 - t0
        if best is None or rtt < best[0]:
            best = (rtt, tw - (t0 + t1) / 2.0)
    assert best is not None, "samples must be >= 1"
    rtt, offset = best
    uncertainty = rtt / 2.0
    local = local_boot if local_boot is not None else boot_id()
    same_host = local is not None and remote_boot == local
    shared = same_host and abs(offset) <= uncertainty
    return ClockOffset(
        offset_s=offset,
        uncertainty_s=uncertainty,
        rtt_min_s=rtt,
        samples=samples,
        same_host=same_host,
        applied_offset_s=0.0 if shared else offset,
        applied_uncertainty_s=0.0 if shared else uncertainty,
    )


def timing_error_budget(
    loop_lag_p99_s: float | None, clocks: Sequence[ClockOffset] = ()
) -> dict[str, Any]:
    """What bounds the run's timing error (seconds), for the manifest.

    A latency measured inside one worker (TTFT, ITL, TPOT, E2E) uses one clock: only the
    client's own event-loop lag bounds it. Times compared across workers (the aggregate
    arrival schedule, concurrency over time, the measured window, joins with server
    timelines) add the clock offsets' uncertainty and their drift during the stage.
    """
    lag = loop_lag_p99_s or 0.0
    unc = max((c.applied_uncertainty_s for c in clocks), default=0.0)
    drift = max((abs(c.drift_s) for c in clocks if c.applied_offset_s != 0.0), default=0.0)
    return {
        "loop_lag_p99_s": lag,
        "clock_offset_uncertainty_s": unc,
        "clock_drift_s": drift,
        "within_one_worker_s": lag,
        "across_workers_s": lag + unc + drift,
    }
