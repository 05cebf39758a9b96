"""Whether a run can be tuned from: each gate's verdict with its reason and counts.

`servelab tune` replays a run and predicts from it, so a run that does not measure what it
seems to is refused before the replay (``--ignore-gates`` turns refusals into notes):

- ``invalid``: the run is marked invalid (the client fell behind, the target changed...).
- ``errors``: more than ``MAX_ERROR_SHARE`` of its requests failed; fewer are flagged, and
  they replay as failures (``sim.fit.asrun.AsRun.failed``).
- ``too_small``: a class in the objective's scope has too few completed requests to decide
  the objective: a percentile ``pQ`` needs ``TAIL_REQUESTS`` requests beyond it, so
  ``TAIL_REQUESTS / (1 - Q)`` per class (p95: 100, p99: 500); a mean, a share (goodput)
  or a rate needs ``MIN_PER_CLASS``.
- ``warm_cache``: the prefix cache was not flushed before the run (the server declined),
  so its first requests may have found earlier traffic's prompts cached, which a replay
  from an empty cache does not.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from servelab.rundir import Run

MAX_ERROR_SHARE = 0.05
TAIL_REQUESTS = 5
MIN_PER_CLASS = 30


@dataclass(frozen=True)
class Gate:
    """One gate's verdict on a run: ``refused`` it, or flagged it (``refused`` False)."""

    name: str
    refused: bool
    reason: str
    counts: dict[str, Any] = field(default_factory=dict)


def needed_per_class(figure: str) -> int:
    """Completed requests per class that decide ``figure`` (see the module doc)."""
    m = re.search(r"_p(\d+(?:\.\d+)?)$", figure)
    if m is None:
        return MIN_PER_CLASS
    q = float(m.group(1)) / 100
    return max(MIN_PER_CLASS, math.ceil(TAIL_REQUESTS / (1 - q) - 1e-9))


def _errors(run: Run) -> Gate | None:
    failed = [r for r in run.records if not r.ok]
    if not failed:
        return None
    n, share = len(run.records), len(failed) / len(run.records)
    (common, times), *_ = Counter(str(r.error) for r in failed).most_common(1)
    counts = {"failed": len(failed), "requests": n, "share": share}
    if share > MAX_ERROR_SHARE:
        return Gate(
            "errors",
            True,
            f"{len(failed)} of its {n} requests failed ({share:.0%}, more than "
            f"{MAX_ERROR_SHARE:.0%}; {times} of them: {common[:80]}): the server it measured "
            "is not the one a replay would predict",
            counts,
        )
    return Gate(
        "errors",
        False,
        f"{len(failed)} of its {n} requests failed ({share:.1%}); they replay as failures",
        counts,
    )


def _too_small(run: Run, scope: str, figure: str) -> Gate | None:
    need = needed_per_class(figure)
    done = Counter(r.workload_class for r in run.records if r.ok)
    classes = run.classes if scope == "overall" else [scope]
    short = {c: done.get(c, 0) for c in classes if done.get(c, 0) < need}
    if not short:
        return None
    has = ", ".join(f"{c} {n}" for c, n in short.items())
    return Gate(
        "too_small",
        True,
        f"too few completed requests to decide {figure}: {has}; it needs at least {need} per "
        "class"
        + (f" ({TAIL_REQUESTS} beyond the percentile)" if need > MIN_PER_CLASS else "")
        + ": run it longer",
        {"needed_per_class": need, "per_class": short},
    )


def _warm_cache(run: Run) -> Gate | None:
    if run.engine_config.get("enable_prefix_caching") is False:
        return None
    said = [
        str(st.get("prefix_cache"))
        for st in run.manifest.get("stages") or []
        if st.get("prefix_cache") not in (None, "", "flushed")
    ]
    if not said:
        return None
    return Gate(
        "warm_cache",
        True,
        f"its prefix cache was not flushed before it ran ({said[0]}), so its first requests "
        "may have found earlier traffic's prompts cached, as a replay from an empty cache "
        "does not; for vLLM, set VLLM_SERVER_DEV_MODE=1 and run it again",
        {"prefix_cache": said},
    )


def gates(run: Run, scope: str, figure: str) -> list[Gate]:
    """Every gate that refuses or flags ``run`` for an objective of ``figure`` over
    ``scope`` ("overall" or a class); empty when the run passes them all."""
    out = []
    if not run.valid:
        out.append(
            Gate("invalid", True, f"it is marked invalid: {run.invalid_reason or 'no reason'}")
        )
    out += [
        g for g in (_errors(run), _too_small(run, scope, figure), _warm_cache(run)) if g is not None
    ]
    return out
