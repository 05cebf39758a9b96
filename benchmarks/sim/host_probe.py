"""The host's own speed beside each launch: a probe that reads nothing the server does.

This machine's speed wanders over minutes (docs/design/sim.md, twin.md): one decode took
23 ms on one launch and 35 ms on another ten minutes later, and within one held-out run the
cases' step speeds rose from 0.93 to 1.18 of the fit. No twin fitted before a launch can
know that; what can be known is the host's speed at the launch, measured the way this
project measures a machine's limits, in the same run.

``measure`` times a fixed numpy workload on the server's CPU just before the server starts
(the core is idle then): an fp32 matrix product (compute) and an fp32 matrix-vector product
over 64 MB (memory). ``factors`` turns the probes into each launch's host factor: the
geometric mean of its two times over the fitted launches' geometric mean (above 1: the host
ran slower than when the twin was fitted). ``scaled_twin`` is a twin file whose every step
price (the fit and each bootstrap draw) is multiplied by a factor: the same twin on a host
that much slower, simulated again rather than its figures scaled, so queueing follows.

The protocol's score stays the plain twin's; the host-adjusted score is reported beside
it, as a measure of how much of a miss was the host's (docs/design/twin.md). On the four
runs it has been beside so far the host did not drift and the factors did not follow the
step speeds (a few percent of the probe's own noise): it is a record beside each launch,
not a correction, until a run the host drifts through shows what it sees.
"""

from __future__ import annotations

import copy
import json
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PROBE = """
import time
import numpy as np
rng = np.random.default_rng(0)
a = rng.standard_normal((576, 1536), dtype=np.float32)
x = rng.standard_normal((256, 576), dtype=np.float32)
m = rng.standard_normal((16384, 1024), dtype=np.float32)  # 64 MB, past every cache
v = rng.standard_normal(1024, dtype=np.float32)
def median_ms(f, n):
    f()
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3
print(median_ms(lambda: x @ a, 31), median_ms(lambda: m @ v, 15))
"""
PARTS = ("matmul_ms", "gemv_ms")


def measure(cpu: int) -> dict[str, float]:
    """The probe's two times (ms) on ``cpu``, about a second of work. Raises on failure."""
    out = subprocess.run(
        ["taskset", "-c", str(cpu), sys.executable, "-c", PROBE],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout.split()  # fmt: skip
    return dict(zip(PARTS, map(float, out), strict=True))


def speed(probe: Mapping[str, float]) -> float:
    """One number per probe: the geometric mean of its parts' times."""
    return statistics.geometric_mean(probe[p] for p in PARTS)


def factors(
    probes: Mapping[str, Mapping[str, float]], fitted: Sequence[str]
) -> dict[str, float] | None:
    """Each probed launch's host factor: its ``speed`` over the geometric mean of the
    ``fitted`` launches' (the ones the twin was fitted to). None when none of those was
    probed (there is nothing to compare against)."""
    ref = [speed(probes[k]) for k in fitted if k in probes]
    if not ref:
        return None
    base = statistics.geometric_mean(ref)
    return {k: speed(p) / base for k, p in probes.items()}


def scaled_twin(twin: Mapping[str, Any], factor: float) -> dict[str, Any]:
    """``twin`` (a twin file's JSON) with its step prices and every bootstrap draw's
    multiplied by ``factor``; everything else (relative spreads, the API's own time, the
    settings) as it was."""
    doc = copy.deepcopy(dict(twin))
    doc["cost"] = {k: v * factor for k, v in doc["cost"].items()}
    doc["bootstrap"] = [{k: v * factor for k, v in b.items()} for b in doc.get("bootstrap", [])]
    return doc


def write_scaled_twin(cal_path: Path, factor: float, out: Path) -> Path:
    """``scaled_twin`` of the file at ``cal_path``, written to ``out``; returns ``out``."""
    out.write_text(json.dumps(scaled_twin(json.loads(cal_path.read_text()), factor)))
    return out
