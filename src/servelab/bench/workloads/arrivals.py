"""Arrival processes: when each open-loop request is meant to be sent.

Every function yields send times in seconds from the start of the run, forever (the
caller stops by count or duration). All take a numpy ``Generator`` so a plan is
reproducible from its seed.

- ``poisson``: exponential gaps at ``rate``.
- ``gamma``: gamma gaps with shape ``burstiness`` and mean ``1/rate``; the coefficient of
  variation is ``1/sqrt(burstiness)`` (vLLM's ``--burstiness``; 1 is Poisson, < 1 burstier).
- ``constant``: one request every ``1/rate`` seconds.
- ``onoff``: Poisson at ``rate`` for ``on`` seconds, then silence for ``off`` seconds, repeating.
- ``ramp``: a Poisson process whose rate grows linearly from ``rate`` to ``ramp_to`` over
  ``ramp_over`` seconds, then stays at ``ramp_to``.
- ``rate == inf``: every request at time 0 (vLLM's behaviour).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

ARRIVALS = ("poisson", "gamma", "constant", "onoff", "ramp")
_BATCH = 1024  # gaps drawn per numpy call


def _gaps(rng: np.random.Generator, draw) -> Iterator[float]:
    while True:
        yield from draw(rng, _BATCH).tolist()


def arrival_times(
    kind: str,
    rate: float,
    rng: np.random.Generator,
    *,
    burstiness: float = 1.0,
    on: float | None = None,
    off: float | None = None,
    ramp_to: float | None = None,
    ramp_over: float | None = None,
) -> Iterator[float]:
    """Send times (s from start) of an open-loop process; see the module doc for ``kind``."""
    if kind not in ARRIVALS:
        raise ValueError(f"unknown arrival process {kind!r}; use one of {', '.join(ARRIVALS)}")
    if not rate > 0:
        raise ValueError(f"--rate must be > 0 requests/s, got {rate}")
    if math.isinf(rate):
        return _forever(0.0)
    if kind == "poisson":
        return _cumsum(_gaps(rng, lambda r, n: r.exponential(1.0 / rate, n)))
    if kind == "gamma":
        if not burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {burstiness}")
        return _cumsum(_gaps(rng, lambda r, n: r.gamma(burstiness, 1.0 / (rate * burstiness), n)))
    if kind == "constant":
        return (i / rate for i in _count())
    if kind == "onoff":
        if not on or on <= 0 or off is None or off < 0:
            raise ValueError("on/off arrivals need on > 0 and off >= 0 seconds (--on-off 5s,10s)")
        active = _cumsum(_gaps(rng, lambda r, n: r.exponential(1.0 / rate, n)))
        # Arrivals in "active time" are laid out over on-periods separated by off-periods.
        return (math.floor(t / on) * (on + off) + math.fmod(t, on) for t in active)
    if ramp_to is None or not ramp_to > 0 or not ramp_over or ramp_over <= 0:
        raise ValueError("ramp arrivals need --ramp-to RATE > 0 and a ramp duration > 0")
    unit = _cumsum(_gaps(rng, lambda r, n: r.exponential(1.0, n)))
    return (_invert_ramp(s, rate, ramp_to, ramp_over) for s in unit)


def _invert_ramp(s: float, r0: float, r1: float, T: float) -> float:
    """Time t with cumulative intensity Lambda(t) == s for a linear ramp r0 -> r1 over T."""
    full = r0 * T + (r1 - r0) * T / 2.0
    if s >= full:
        return T + (s - full) / r1
    a = (r1 - r0) / (2.0 * T)
    if abs(a) < 1e-15:
        return s / r0
    # a t^2 + r0 t - s = 0, positive root, written to avoid cancellation
    return 2.0 * s / (r0 + math.sqrt(r0 * r0 + 4.0 * a * s))


def _cumsum(gaps: Iterator[float]) -> Iterator[float]:
    # The first request goes at 0 so that a run starts at once, as the other processes do.
    t = 0.0
    yield t
    for g in gaps:
        t += g
        yield t


def _count() -> Iterator[int]:
    i = 0
    while True:
        yield i
        i += 1


def _forever(x: float) -> Iterator[float]:
    while True:
        yield x
