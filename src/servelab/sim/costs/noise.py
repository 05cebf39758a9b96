"""Step-time noise: how far real steps stray from the cost model, measured and replayed.

A profiled cost model predicts a shape's typical step time, but the same shape takes
different times from one step to the next on a real machine (caches, frequency, the
server's own threads sharing the cores), and the variation wanders: consecutive steps
are alike. Pooled ITL percentiles are percentiles of a mixture of step shapes, so they
depend on that spread, not only on the typical times: a simulation with every step at its
typical time had the right mean ITL but a p50 and p95 5-11% low (docs/design/sim.md).

:class:`StepNoise` is the measured distribution of ``log(measured / predicted)`` over the
steps of real runs (as quantiles) and the lag-1 correlation of consecutive steps.
:meth:`StepNoise.sampler` draws one factor per step with that distribution and that
correlation: a Gaussian AR(1) series mapped through the quantiles, from a seeded
generator, so a simulation stays deterministic.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from statistics import NormalDist

# Stored quantiles of the log ratio: QUANTILES of them, evenly spaced in probability from
# TAIL to 1 - TAIL. The extremes are left out: a single stalled step among a thousand
# would otherwise stretch the whole last interval of the table.
QUANTILES = 101
TAIL = 0.005
_STD = NormalDist()


@dataclass(frozen=True)
class StepNoise:
    """``log_quantiles``: quantiles of log(measured / predicted) at evenly spaced
    probabilities from ``TAIL`` to ``1 - TAIL``; ``autocorr``: lag-1 correlation of consecutive steps
    (of their normal scores); ``steps``: how many steps it was measured on."""

    log_quantiles: tuple[float, ...]
    autocorr: float
    steps: int

    @classmethod
    def measure(cls, runs: list[list[float]]) -> StepNoise | None:
        """From each run's ratios measured / predicted, in step order. None under 20 steps."""
        logs = [[math.log(r) for r in run if r > 0] for run in runs]
        pooled = sorted(x for run in logs for x in run)
        n = len(pooled)
        if n < 20:
            return None
        probs = [TAIL + (1 - 2 * TAIL) * i / (QUANTILES - 1) for i in range(QUANTILES)]
        quantiles = tuple(_interp(pooled, p * (n - 1)) for p in probs)
        # Normal scores (ranks through the Gaussian quantile), so that the correlation is the
        # latent AR(1) coefficient whatever the shape of the distribution.
        rank = {x: i for i, x in enumerate(pooled)}
        pairs: list[tuple[float, float]] = []
        for run in logs:
            z = [_STD.inv_cdf((rank[x] + 0.5) / n) for x in run]
            pairs += itertools.pairwise(z)
        num = sum(a * b for a, b in pairs)
        den = math.sqrt(sum(a * a for a, _ in pairs) * sum(b * b for _, b in pairs))
        autocorr = min(max(num / den, 0.0), 0.99) if den > 0 else 0.0
        return cls(quantiles, autocorr, n)

    def to_dict(self) -> dict:
        return {
            "log_quantiles": list(self.log_quantiles),
            "autocorr": self.autocorr,
            "steps": self.steps,
        }

    @classmethod
    def from_dict(cls, d: dict) -> StepNoise:
        return cls(tuple(float(x) for x in d["log_quantiles"]), float(d["autocorr"]), d["steps"])

    def sampler(self, seed: int) -> NoiseSampler:
        return NoiseSampler(self, seed)


class NoiseSampler:
    """Calling it gives the next step's factor (see :class:`StepNoise`)."""

    __slots__ = ("_innov", "_last", "_phi", "_q", "_rng", "_z")

    def __init__(self, noise: StepNoise, seed: int) -> None:
        self._rng = random.Random(f"step-noise:{seed}")
        self._phi = noise.autocorr
        self._innov = math.sqrt(1.0 - noise.autocorr**2)
        self._z = self._rng.gauss(0.0, 1.0)  # the series starts in its stationary state
        self._q = noise.log_quantiles
        self._last = len(noise.log_quantiles) - 1

    def __call__(self) -> float:
        self._z = self._phi * self._z + self._innov * self._rng.gauss(0.0, 1.0)
        pos = (_STD.cdf(self._z) - TAIL) / (1 - 2 * TAIL) * self._last
        return math.exp(_interp(self._q, min(max(pos, 0.0), self._last)))


def _interp(values: list[float] | tuple[float, ...], pos: float) -> float:
    """``values`` read at fractional index ``pos`` (0 <= pos <= len - 1), linearly."""
    if len(values) == 1:
        return values[0]
    i = min(int(pos), len(values) - 2)
    return values[i] + (values[i + 1] - values[i]) * (pos - i)
