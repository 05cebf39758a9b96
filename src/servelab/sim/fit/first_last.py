"""A twin's step cost from runs that keep each request's first and last token times alone.

GuideLLM and vLLM's spans (``servelab import``; the run ``lacks`` ``rundir.LACKS_TOKEN_TIMES``)
record when a request's first token came, when it ended and its token counts, not when each
token came: no step can be inferred (concurrent streams' tokens spread evenly over their own
windows do not line up into shared steps). Each request gives rows of the twin's fit instead
(``twin.TERMS`` and its idle-start column, through ``twin.trimmed_fit``):

- **its decode window**, first token to end: ``output_tokens - 1`` steps, one token each (a
  continuous batch puts every decoding request in every step), the row their mean step. Its
  work: every request's decode tokens spread evenly over that request's own window, counted
  where they fall in this one at their context, and the prompts whose first token came inside
  it (computed in the steps up to their first token);
- **its TTFT** where it found the server idle (no request in flight at its send) and no
  other's first token came before its own: the prompts finished with its first token (within
  ``SAME_STEP_S``) in one step, or as many as the token budget needs, and the API's time.

The speed spread is taken over the windows' ratios to the fit by their end (5 s windows, as
the twin's), the form spread over the rows. There is no step noise: a window's mean hides
how one step strays, so the twin prices every step of one shape alike.

Where every fitted window's mean batch was about the same (``NARROW_BATCH_SPAN``: a run at
one fixed concurrency, equal lengths), a step's fixed price and its price per decode are
collinear: the fit cannot tell them apart, and predictions at another batch extrapolate
(GuideLLM's run at four streams gave a twin whose TPOT p50 at eight was 91% high). The fit
is kept and says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from servelab.analyze.server_side.stepinfer import estimated_cached, prefill_size
from servelab.rundir import Run
from servelab.sim.fit.twin import (
    BOOTSTRAP,
    MIN_ROWS,
    TERMS,
    TwinFit,
    bootstrap_refits,
    coef_dict,
    form_spread,
    most_at_once,
    speed_spread,
    trimmed_fit,
)

FIRST_AND_LAST = "first_and_last"  # ``fit.token_times`` of a twin fitted this way
# First tokens this close came from one step: on live vLLM-CPU one step's chunks reached the
# client within 0.1-0.5 ms (p99 1.8 ms at four streams), the next step's 17 ms or more later.
SAME_STEP_S = 0.002
# Decode windows whose mean batch spans less than this (90th over 10th percentile) saw one
# batch size: percentiles, so a closed loop's ramp-up and drain windows do not count as a
# second one.
NARROW_BATCH_SPAN = 1.5


def run_rows(
    run: Run, budget: int | None, chunked: bool
) -> tuple[list[list[float]], list[float], list[float], dict[str, Any]]:
    """One run's rows (module doc): features (``TERMS`` and the idle-start column), lengths,
    the client time each ends at, and what they were made of."""
    import numpy as np

    recs = [
        r
        for r in run.records
        if r.ok and r.stream and r.chunk_times and r.done is not None and r.input_tokens > 0
    ]
    estimated = estimated_cached(recs, run.scrapes)
    first = np.array([r.chunk_times[0] for r in recs])
    size = np.array([prefill_size(r, estimated) for r in recs], dtype=float)
    cached = np.array([r.input_tokens for r in recs], dtype=float) - size
    dec = [
        k
        for k, r in enumerate(recs)
        if r.output_tokens >= 2 and r.done is not None and r.done > r.chunk_times[0]
    ]
    start, end = first[dec], np.array([recs[k].done or 0.0 for k in dec])
    steps = np.array([recs[k].output_tokens - 1 for k in dec], dtype=float)
    gap = (end - start) / steps
    prompt = np.array([recs[k].input_tokens for k in dec], dtype=float)
    a: list[list[float]] = []
    y: list[float] = []
    ends: list[float] = []
    batch: list[float] = []
    for i in range(len(dec)):
        lo, hi = start[i], end[i]
        # every request's decode tokens, evenly spread over its window, inside this one
        u0 = (np.maximum(start, lo) - start) / gap
        u1 = (np.minimum(end, hi) - start) / gap
        count = np.clip(u1 - u0, 0.0, None)
        kv = float(np.sum(count * (prompt + (u0 + u1) / 2)))
        inside = (first > lo) & (first <= hi)
        p, c = size[inside], cached[inside]
        pairs = float(np.sum(p * c + p * (p + 1) / 2))
        row = [steps[i], float(count.sum()), float(p.sum()), kv + float(np.sum(c + p)), kv + pairs]
        a.append([v / steps[i] for v in row] + [0.0])
        y.append(float(gap[i]))
        ends.append(float(hi))
        batch.append(float(count.sum()) / steps[i])
    sent = np.array([r.actual_send for r in recs])
    done = np.array([r.done or math.inf for r in recs])
    idle = 0
    for i in range(len(recs)):
        others = np.arange(len(recs)) != i
        if np.any(others & (sent <= sent[i]) & (sent[i] < done)) or np.any(
            (first > sent[i]) & (first < first[i] - SAME_STEP_S)
        ):
            continue  # the server was busy, or computed another's prompt first
        same = np.abs(first - first[i]) <= SAME_STEP_S
        p, c = size[same], cached[same]
        total = float(p.sum())
        n = max(1, math.ceil(total / budget)) if chunked and budget else 1
        pairs = float(np.sum(p * c + p * (p + 1) / 2))
        a.append([float(n), 0.0, total, float(np.sum(c + p)), pairs, 1.0])
        y.append(float(first[i] - sent[i]))
        ends.append(float(first[i]))
        idle += 1
    diag = {
        "requests": len(recs),
        "decode_windows": len(dec),
        "idle_prefills": idle,
        "mean_batch": float(np.mean(batch)) if batch else 0.0,
        "max_batch": most_at_once(list(zip(start, end))),
    }
    return a, y, ends, diag


def fit_first_and_last(
    runs: Sequence[Run],
    budget: int | None,
    chunked: bool,
    fits: Callable[[float], bool] | None = None,
    bootstrap: int = BOOTSTRAP,
) -> tuple[TwinFit, dict[str, Any]]:
    """The twin's prices fitted to the rows of ``runs`` (module doc) that end at a time
    ``fits`` keeps (None: all), and what the rows were made of. ValueError when too few."""
    import numpy as np

    rows, diags = [], []
    for k, run in enumerate(runs):
        xs, ys, ends, diag = run_rows(run, budget, chunked)
        rows += [
            (k, x, v, t) for x, v, t in zip(xs, ys, ends) if v > 0 and (fits is None or fits(t))
        ]
        diags.append(diag)
    if len(rows) < MIN_ROWS:
        raise ValueError(
            f"only {len(rows)} requests' decode windows and idle prefills could be timed from "
            "their first and last token times; calibrate on a streamed run with more "
            "requests of two or more output tokens"
        )
    a = np.array([x for _, x, _, _ in rows])
    y = np.array([v for _, _, v, _ in rows])
    coef, keep = trimmed_fit(a, y)
    rows = [row for row, kept in zip(rows, keep) if kept]
    a, y = a[keep], y[keep]
    ratio = y / np.maximum(a @ coef, 1e-9)
    err = np.abs(ratio - 1.0)
    by_run: list[list[tuple[float, float]]] = [[] for _ in runs]
    for (k, _, _, t), r in sorted(zip(rows, ratio), key=lambda p: p[0][3]):
        by_run[k].append((t, float(r)))
    fit = TwinFit(
        coef=coef_dict(coef),
        api=float(coef[len(TERMS)]),
        bootstrap=bootstrap_refits(a, y, bootstrap),
        noise=None,
        error={
            "median": float(np.median(err)),
            "p90": float(np.percentile(err, 90)),
            "windows": len(err),
        },
        rows=len(keep),
        trimmed=int(len(keep) - len(y)),
        speed_spread=speed_spread(by_run),
        form_spread=form_spread(a, y),
    )
    return fit, {
        key: (max if key == "max_batch" else sum)(d[key] for d in diags)
        for key in ("requests", "decode_windows", "idle_prefills", "max_batch")
    } | {"mean_batch": float(np.mean([d["mean_batch"] for d in diags]))} | batch_span(a)


def batch_span(a: Any) -> dict[str, Any]:
    """How far the mean batch of the fitted decode windows (rows of ``a`` without the
    idle-start column) varied: ``batch_span``, their 90th over their 10th percentile,
    ``batch_median`` and ``narrow_batch`` (below ``NARROW_BATCH_SPAN``). None and False
    without a decode window."""
    import numpy as np

    batch = a[a[:, -1] == 0.0, 1]
    if not len(batch):
        return {"batch_span": None, "batch_median": None, "narrow_batch": False}
    lo, hi = np.percentile(batch, [10, 90])
    span = float(hi / lo)  # a window's mean batch counts its own request: never below 1
    return {
        "batch_span": span,
        "batch_median": float(np.median(batch)),
        "narrow_batch": span < NARROW_BATCH_SPAN,
    }
