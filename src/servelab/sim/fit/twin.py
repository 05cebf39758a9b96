"""A twin of another server (vLLM, SGLang, llama.cpp): its step cost fitted to one benchmark run.

A run against another server has no step records, only what its client saw. The steps are
inferred from the streams' chunk arrivals (:mod:`servelab.analyze.server_side.stepinfer`) and a step cost
of the form::

    time = step + a * decode_seqs + b * prefill_tokens + c * kv_read + d * attn_pairs

is fitted to them by non-negative least squares on relative error (weights from the fitted
values after a first pass, as in :mod:`servelab.sim.costs.profiled`), after which rows more than
``TRIM`` median absolute deviations off in log ratio are dropped once and the fit is redone.
Each row is one interval between the ends of two steps the client saw: its measured length
against the sum of the work of the steps in it (the one it saw and any that streamed nothing
before it). A step that began after an idle gap is measured from its first request's send,
and one more column, that request's way in and its first token's way out, is fitted with it.

The API's own time per request (HTTP, tokenisation, detokenisation, the first chunk's way
back) is the median of the client's TTFT less the server's queue and prefill where the server
reports them (vLLM ``metrics``) and less the wait for the step in progress when the request
reached the engine (which the twin simulates), else that fitted column; the simulation puts half of it on
each way (``Scenario.network_delay``). The step noise is the spread of the single steps
around the fit (:mod:`servelab.sim.costs.noise`). ``BOOTSTRAP`` refits on rows resampled with
replacement give the coefficients' uncertainty, and the spread of the server's speed over
the run (``speed_spread``: the median step's ratio to the fit in 5 s windows) how far a
later run may sit from it. Neither says how wrong the form itself is for steps unlike the
ones it was fitted on; ``form_spread`` measures that out of sample within the run: fitted
to the lighter half of the steps (by decodes) it prices the heavier half, and the reverse
where the heavier half ran more than one decode count, and the log of the median
measured / priced ratio of each is one error. Simulation seed
``k > 0`` prices steps with the ``k``-th refit times a speed factor drawn from both spreads,
so repeating a prediction over seeds spreads it by the step noise, what one run could not
pin down, the host's drift and the form's error away from the run's own load.

A run that keeps each request's first and last token times alone (``rundir.LACKS_TOKEN_TIMES``)
has no steps to infer: :mod:`servelab.sim.fit.first_last` fits the same prices to its requests'
decode windows and idle prefills instead, and the file says so (``fit.token_times``).

With several runs, :mod:`servelab.sim.fit.held_out` replays each run on the twin fitted to
the others and turns the figures' errors into 80% and 95% interval half-widths
(``intervals``; ``calibrate_runs`` leaves them None). The calibration file also
records the tokenizer that counted the served model's tokens (``run_tokenizer``) and what
the runs spanned (``domain_of``), which ``servelab sim`` checks a scenario against
(``outside_domain``), and how much of a burst an idle server's first step took
by the length of its prompts (``first_steps``, :mod:`servelab.sim.fit.first_step`), which the
twin's serving path replays.

The scheduler settings are the server's (:mod:`servelab.analyze.server_side.serversettings`: what it
reports, the launch command, what the user stated, published defaults), then the defaults of
its engine on the stated hardware (:mod:`servelab.sim.engine_defaults`), then what the run
showed (the most streams one step served bounds ``max_num_seqs`` from below); the calibration
file records each setting's source. The simulated engine is servelab's own scheduler run with
those settings: it chunks, budgets, caps and caches as vLLM's V1 scheduler does; SGLang's
separate prefill and decode batches and llama.cpp's slots are approximated by it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from servelab.analyze.server_side.serversettings import (
    LLAMACPP,
    SGLANG,
    VLLM,
    ServerSettings,
    server_settings,
)
from servelab.analyze.server_side.stepinfer import InferredStep, SeqWork, StepInference, infer_steps
from servelab.engine.engine_config import EngineConfig
from servelab.rundir import LACKS_TOKEN_TIMES, Run
from servelab.sim.costs.noise import StepNoise
from servelab.sim.costs.serving_path import ServingPath
from servelab.sim.costs.work import StepWork, decode_work
from servelab.sim.fit.first_step import first_steps
from servelab.sim.sim_target import SimTarget

FORMAT = "servelab-twin/1"
TERMS = ("step", "decode_seqs", "prefill_tokens", "kv_read", "attn_pairs")
BOOTSTRAP = 32
TRIM = 5.0  # median absolute deviations of log(measured / fitted) beyond which a row is dropped
DRIFT_WINDOW_S = 5.0
DRIFT_MIN_STEPS = 10
MIN_ROWS = 8
SCHEDULE_SLACK_S = 0.005  # a scheduling moment this close to a step end is that end
_CONFIG_KEYS = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "block_size",
    "max_model_len",
    "num_kv_blocks",
    "prefix_cache_scope",
)


class TwinCostModel:
    """The fitted step cost (module doc); ``coef`` maps each of ``TERMS`` to its price."""

    def __init__(self, coef: dict[str, float], label: str = "twin") -> None:
        self.coef = {t: float(coef.get(t, 0.0)) for t in TERMS}
        self._c = tuple(self.coef[t] for t in TERMS)
        self.name = label

    def predict(self, w: StepWork) -> float:
        c = self._c
        return (
            c[0]
            + c[1] * w.decode_seqs
            + c[2] * w.prefill_tokens
            + c[3] * w.kv_read
            + c[4] * w.attn_pairs
        )

    def decode_time(self, num_seqs: int, context_tokens: int) -> float:
        return self.predict(decode_work(num_seqs, context_tokens))

    def describe(self) -> dict[str, Any]:
        return {"kind": "twin", "label": self.name, "coef": self.coef}


def step_work(seqs: list[SeqWork]) -> StepWork:
    w = StepWork()
    for s in seqs:
        w.add(s.new_tokens, s.context_before, 1 if s.sampled else 0)
    return w


def _features(w: StepWork) -> list[float]:
    return [1.0, float(w.decode_seqs), float(w.prefill_tokens), float(w.kv_read), w.attn_pairs]


def _row(step: InferredStep) -> tuple[list[float], float, bool]:
    """(features of every step in the interval, its length, whether it started idle)."""
    x = _features(step_work(step.seqs))
    for hidden in step.hidden:
        x = [a + b for a, b in zip(x, _features(step_work(hidden)))]
    idle = step.start is None
    begin = step.arrival if idle else step.start
    assert begin is not None
    return [*x, 1.0 if idle else 0.0], step.end - begin, idle


def _nnls(a: Any, y: Any) -> Any:
    """Non-negative least squares on relative error, reweighted by the fitted values."""
    import numpy as np
    from scipy.optimize import nnls

    col = np.maximum(np.abs(a).max(axis=0), 1e-12)
    weight = 1.0 / np.maximum(y, 1e-6)
    coef = np.zeros(a.shape[1])
    for _ in range(3):
        sol, _ = nnls(a / col * weight[:, None], y * weight, maxiter=50 * a.shape[1])
        coef = sol / col
        weight = 1.0 / np.maximum(a @ coef, 1e-6)
    return coef


@dataclass
class TwinFit:
    """The fitted prices (``coef``, and ``api`` for the idle-start column), the bootstrap
    refits, the noise, and how well it fits (``error``: |fitted - measured| / measured over
    the single steps with a known start)."""

    coef: dict[str, float]
    api: float
    bootstrap: list[dict[str, float]]
    noise: StepNoise | None
    error: dict[str, float]
    rows: int
    trimmed: int
    speed_spread: float | None = None
    form_spread: float | None = None


def fit_steps(infs: Sequence[StepInference], bootstrap: int = BOOTSTRAP, seed: int = 0) -> TwinFit:
    """Fit the step cost to the usable inferred steps of one or more runs of one server
    (module doc). ValueError when too few."""
    import numpy as np

    timed = [(k, s, *_row(s)) for k, inf in enumerate(infs) for s in inf.steps if s.usable]
    timed = [t for t in timed if t[3] > 0]
    if len(timed) < MIN_ROWS:
        raise ValueError(
            f"only {len(timed)} steps could be timed from the client's chunks (of "
            f"{sum(len(inf.steps) for inf in infs)} inferred); calibrate on a streamed run "
            "with a few hundred tokens and some concurrency"
        )
    a = np.array([t[2] for t in timed])
    y = np.array([t[3] for t in timed])
    coef, keep = trimmed_fit(a, y)
    if not keep.all():
        a, y = a[keep], y[keep]
        timed = [t for t, k in zip(timed, keep) if k]
    fitted = a @ coef
    # The noise and the error are over single steps with a known start, in step order.
    single: list[list[tuple[float, float]]] = [[] for _ in infs]
    for i, (k, step, *_) in enumerate(timed):
        if step.start is not None and not step.hidden and fitted[i] > 0:
            single[k].append((step.end, float(y[i] / fitted[i])))
    ratios = [[r for _, r in run] for run in single]
    err = [abs(r - 1.0) for run in ratios for r in run]
    return TwinFit(
        coef=coef_dict(coef),
        api=float(coef[len(TERMS)]),
        bootstrap=bootstrap_refits(a, y, bootstrap, seed),
        noise=StepNoise.measure(ratios),
        error={
            "median": float(np.median(err)) if err else math.nan,
            "p90": float(np.percentile(err, 90)) if err else math.nan,
            "steps": len(err),
        },
        rows=len(keep),
        trimmed=int(len(keep) - len(y)),
        speed_spread=speed_spread(single),
        form_spread=form_spread(a, y),
    )


def trimmed_fit(a: Any, y: Any) -> tuple[Any, Any]:
    """The prices of rows ``a`` (the work of ``TERMS`` and the idle-start column) against
    lengths ``y``: fitted, rows more than ``TRIM`` median absolute deviations off in log
    ratio dropped once (when ``MIN_ROWS`` remain) and refitted. (coefficients, rows kept)."""
    import numpy as np

    coef = _nnls(a, y)
    log_ratio = np.log(y / np.maximum(a @ coef, 1e-9))
    dev = np.abs(log_ratio - np.median(log_ratio))
    keep = dev <= TRIM * (float(np.median(dev)) or 1e-9)
    if keep.sum() >= MIN_ROWS and not keep.all():
        return _nnls(a[keep], y[keep]), keep
    return coef, np.ones(len(y), dtype=bool)


def bootstrap_refits(a: Any, y: Any, n: int, seed: int = 0) -> list[dict[str, float]]:
    """``n`` refits of the prices on rows resampled with replacement."""
    import numpy as np

    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n):
        idx = rng.integers(0, len(y), len(y))
        boots.append(coef_dict(_nnls(a[idx], y[idx])))
    return boots


def speed_spread(runs: Sequence[list[tuple[float, float]]]) -> float | None:
    """How far the server's speed wandered: the standard deviation of the log of the median
    measured / fitted ratio in each ``DRIFT_WINDOW_S`` window (of at least
    ``DRIFT_MIN_STEPS`` steps) of every run (``(step end, ratio)`` each), so that with
    several runs it holds the drift between them beside the drift within each; None with
    fewer than three such windows."""
    import numpy as np

    windows: dict[tuple[int, int], list[float]] = {}
    for k, points in enumerate(runs):
        if not points:
            continue
        t0 = points[0][0]
        for t, r in points:
            windows.setdefault((k, int((t - t0) // DRIFT_WINDOW_S)), []).append(r)
    medians = [float(np.median(v)) for v in windows.values() if len(v) >= DRIFT_MIN_STEPS]
    if len(medians) < 3:
        return None
    return float(np.std(np.log(medians)))


def form_spread(a: Any, y: Any) -> float | None:
    """How far the cost model's form is off on steps heavier or lighter than those it was
    fitted on: the rows split at the median decode count, each half fitted and the other
    priced, the root mean square of the log median measured / priced ratios. A half whose
    steps all ran one decode count cannot tell the step's price from a decode's (a closed
    loop's heavier half is all at its concurrency) and prices nothing. None when either
    half has fewer than ``MIN_ROWS`` rows or neither can be fitted."""
    import numpy as np

    decodes = a[:, TERMS.index("decode_seqs")]
    light = decodes <= np.median(decodes)
    if light.all():  # most steps at the median: split below it instead
        light = decodes < np.median(decodes)
    halves = (light, ~light)
    if min(int(h.sum()) for h in halves) < MIN_ROWS:
        return None
    errs = []
    for fit_on, priced in (halves, halves[::-1]):
        if len(np.unique(decodes[fit_on])) < 2:
            continue
        coef = _nnls(a[fit_on], y[fit_on])
        errs.append(math.log(float(np.median(y[priced] / np.maximum(a[priced] @ coef, 1e-9)))))
    return float(np.sqrt(np.mean(np.square(errs)))) if errs else None


def coef_dict(coef: Any) -> dict[str, float]:
    return {t: float(c) for t, c in zip(TERMS, coef)}


def reported_api_overhead(runs: Sequence[Run], step_ends: list[list[float]]) -> float | None:
    """Median over the runs' requests of the API's own time: TTFT less the server's queue
    and prefill where it reports both (vLLM's per-request ``metrics``), less the wait for
    the step in progress when the request reached the engine.

    An engine loop takes new requests only between steps and the server's queue time starts
    there, so what TTFT leaves over holds that wait beside HTTP and tokenisation; the twin
    simulates the wait itself. The request was scheduled ``queue + prefill`` before its first
    token (client clock). Where that moment is a step end (``step_ends``, each run's from
    step inference; within ``SCHEDULE_SLACK_S``), the request reached the engine after the
    step end before it and after its send: the wait is taken as half of that span.
    Elsewhere the engine was idle and took it at once."""
    import bisect
    import statistics

    vals = []
    for run, run_ends in zip(runs, step_ends):
        ends = sorted(run_ends)
        for r in run.records:
            figs = r.server_timeline or {}
            q, p = figs.get("queue_time"), figs.get("prefill_time")
            if not (
                r.ok
                and r.ttft is not None
                and isinstance(q, (int, float))
                and isinstance(p, (int, float))
            ):
                continue
            scheduled = r.actual_send + r.ttft - q - p
            wait = 0.0
            i = bisect.bisect_left(ends, scheduled - SCHEDULE_SLACK_S)
            if i < len(ends) and ends[i] <= scheduled + SCHEDULE_SLACK_S:
                reached_after = max(ends[i - 1] if i > 0 else r.actual_send, r.actual_send)
                wait = max(0.0, ends[i] - reached_after) / 2
            vals.append(scheduled - r.actual_send - wait)
    return statistics.median(vals) if len(vals) >= 3 else None


@dataclass
class TwinCalibration:
    """What ``servelab calibrate`` writes for a run of another server (see the module doc).

    ``engine_config``: the settings the twin runs with, ``engine_sources``: where each came
    from; ``cost``/``bootstrap``: the fitted prices; ``api_overhead_s``: the API's own time
    per request; ``fit``: errors, step-inference diagnostics and the API figures behind it."""

    server: str
    model: str
    engine_config: dict[str, Any]
    engine_sources: dict[str, str]
    max_model_len: int
    kv_bytes_per_token: float
    cost: dict[str, float]
    bootstrap: list[dict[str, float]]
    noise: dict[str, Any] | None
    api_overhead_s: float
    fit: dict[str, Any]
    settings: dict[str, Any] = field(default_factory=dict)
    run: str = ""
    hardware: str | None = None  # the catalogue entry stated at calibration (None: unknown)
    speed_spread: float | None = None  # log sd of the run's speed over time (speed_spread)
    form_spread: float | None = None  # the form's log error off the run's own load (form_spread)
    tokenizer: str | None = None  # what counts the served model's tokens (run_tokenizer)
    domain: dict[str, list[int]] | None = None  # what the calibration runs spanned (domain_of)
    intervals: dict[str, Any] | None = None  # out-of-sample half-widths (sim.fit.held_out)
    # [mean prompt tokens, share] of each burst's first step (sim.fit.first_step)
    first_steps: list[list[float]] | None = None

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"format": FORMAT, **asdict(self)}, indent=1))
        return p

    @classmethod
    def load(cls, path: str | Path) -> TwinCalibration:
        p = Path(path)
        doc = json.loads(p.read_text())
        if doc.pop("format", None) != FORMAT:
            raise ValueError(f"{p} is not a servelab twin calibration ({FORMAT})")
        if "burst_share" in doc:  # written before shares were kept by prompt length
            share = doc.pop("burst_share")
            doc.setdefault("first_steps", None if share is None else [[1.0, share]])
        return cls(**doc)

    def target(self, draw: int = 0) -> SimTarget:
        """The twin as a simulator target; ``draw`` > 0 prices steps with that bootstrap
        refit (the simulation seed's, so a prediction's spread over seeds carries it)."""
        coef = self.cost
        speed = 1.0
        if draw > 0 and self.bootstrap:
            coef = self.bootstrap[(draw - 1) % len(self.bootstrap)]
        spread = math.hypot(self.speed_spread or 0.0, self.form_spread or 0.0)
        if draw > 0 and spread:
            speed = math.exp(random.Random(f"twin-speed:{draw}").gauss(0.0, spread))
            coef = {k: v * speed for k, v in coef.items()}
        cfg = EngineConfig(**self.engine_config)
        path = None
        if self.first_steps and any(share < 1 for _, share in self.first_steps):
            steps = tuple((tokens, share) for tokens, share in self.first_steps)
            path = ServingPath(first_steps=steps, source="the twin's runs")
        return SimTarget(
            cost_model=TwinCostModel(coef, f"twin:{self.server}:{self.model}"),
            engine_config=cfg,
            max_model_len=self.max_model_len,
            kv_bytes_per_token=self.kv_bytes_per_token,
            label=f"twin:{self.server}:{self.model}",
            step_noise=StepNoise.from_dict(self.noise) if self.noise else None,
            serving_path=path,
            info={
                "twin_of": self.run,
                "server": self.server,
                "engine_sources": self.engine_sources,
                "api_overhead_s": self.api_overhead_s,
                "bootstrap_draw": draw if draw > 0 and self.bootstrap else 0,
                "speed_factor": speed,
                "tokenizer": self.tokenizer or self.model,
                "domain": self.domain,
                "intervals": self.intervals,
            },
        )


def flag_changes(cal: TwinCalibration, flags: str) -> dict[str, Any]:
    """The engine-config changes the server's own ``flags`` make to the twin (its spelling,
    ``serversettings.FLAGS``), as ``servelab sim --engine-args`` takes them; vLLM's budget
    without chunking is the context, as the server itself sets it."""
    from servelab.analyze.server_side.serversettings import parse_flags

    changes = parse_flags(cal.server, flags)
    if "kv_tokens" in changes:
        changes["num_kv_blocks"] = int(changes.pop("kv_tokens")) // int(
            cal.engine_config.get("block_size") or 1
        )
    if cal.server == VLLM and "max_num_batched_tokens" not in changes:
        chunked = changes.get("enable_chunked_prefill")
        if chunked is False:
            changes["max_num_batched_tokens"] = max(
                cal.max_model_len, int(cal.engine_config["max_num_batched_tokens"])
            )
        elif chunked and not cal.engine_config.get("enable_chunked_prefill", True):
            # the run's budget was the context only because it did not chunk
            default = _defaults(VLLM, cal.hardware)[0]["max_num_batched_tokens"]
            changes["max_num_batched_tokens"] = default
    return changes


def server_engine_args(cal: TwinCalibration, text: str | None) -> dict[str, Any]:
    """``servelab sim --engine-args`` for the twin of vLLM, SGLang or llama-server: the
    server's own flags (``--no-enable-chunked-prefill``, ``--chunked-prefill-size 512``,
    ``-np 2``) as engine-config changes, each meaning what it means to that server
    (``flag_changes``). ValueError naming the server for a word it takes no setting from."""
    import shlex

    from servelab.analyze.server_side.serversettings import FLAGS

    table = {name: f for f in FLAGS[cal.server] for name in f.flags}
    toks = shlex.split(text or "")
    i = 0
    while i < len(toks):
        tok = toks[i].split("=", 1)[0]
        f = table.get(tok) or table.get(f"--{tok[5:]}" if tok.startswith("--no-") else "")
        if f is None or (tok.startswith("--no-") and f.kind != "bool"):
            known = ", ".join(sorted(n for g in FLAGS[cal.server] for n in g.flags))
            raise ValueError(
                f"--engine-args {toks[i]!r}: the twin is of {cal.server}, whose flags it takes; "
                f"{cal.server} flags the twin can change: {known}"
            )
        i += 1
        if f.kind in ("value", "value_or_off") and "=" not in toks[i - 1]:
            if i >= len(toks):
                raise ValueError(f"--engine-args {tok}: give it a value")
            i += 1
    return flag_changes(cal, text or "")


def engine_changes(cal: TwinCalibration, changes: dict[str, Any]) -> dict[str, Any]:
    """Engine-config ``changes`` as the twin takes them: written in the server's own flags
    and read back (``flag_changes``), so each means what it means to that server (vLLM
    without chunking computes a prompt in one step). ValueError for a setting the server
    has no flag for."""
    from servelab.analyze.server_side.serversettings import render_flags

    return flag_changes(cal, render_flags(cal.server, changes))


def is_twin_file(path: str | Path) -> bool:
    """Whether ``path`` holds a twin calibration (not the roofline's)."""
    try:
        return json.loads(Path(path).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _defaults(kind: str, hardware: str | None) -> tuple[dict[str, Any], str]:
    from servelab.sim.costs.hardware import get_hardware
    from servelab.sim.engine_defaults import engine_defaults, vllm_cpu_defaults

    hw = get_hardware(hardware) if hardware else None
    on_cpu = hw is None or hw.memory_bytes is None
    if kind == VLLM:
        d = vllm_cpu_defaults() if on_cpu else engine_defaults("vllm", hw)  # type: ignore[arg-type]
    elif kind == SGLANG and not on_cpu:
        d = engine_defaults("sglang", hw)  # type: ignore[arg-type]
    elif kind == LLAMACPP:
        return {"max_num_batched_tokens": 2048, "max_num_seqs": 4}, (
            "llama.cpp common/common.h n_batch 2048; tools/server/server.cpp: --parallel "
            "auto is 4 slots"
        )
    else:
        return {}, ""
    return d.config, f"{d.source} [{d.hardware_class}]"


def engine_settings(
    settings: ServerSettings, peak: int, hardware: str | None
) -> tuple[dict[str, Any], dict[str, str], int]:
    """The twin's EngineConfig fields, their sources and the context length (module doc);
    ``peak``: the most streams one step of the runs served (a lower bound of the cap)."""
    values = dict(settings.values)
    sources = dict(settings.sources)
    defaults, source = _defaults(settings.kind, hardware)
    for k, v in defaults.items():
        if k not in values:
            values[k], sources[k] = v, source
    if "max_num_seqs" not in values:
        values["max_num_seqs"] = max(1, peak)
        sources["max_num_seqs"] = "the run: the most streams one step served (a lower bound)"
    if "max_num_batched_tokens" not in values:
        values["max_num_batched_tokens"] = EngineConfig().max_num_batched_tokens
        sources["max_num_batched_tokens"] = "unknown: servelab's default assumed"
    length = int(values.get("max_model_len") or 8192)
    if "max_model_len" not in values:
        sources["max_model_len"] = "unknown: 8192 assumed"
    values["max_model_len"] = length
    block = int(values.get("block_size") or 16)
    values["block_size"] = block
    if "num_kv_blocks" not in values and values.get("kv_tokens"):
        values["num_kv_blocks"] = int(values["kv_tokens"]) // block
        sources["num_kv_blocks"] = sources.get("kv_tokens", "")
    if "num_kv_blocks" not in values:
        values["num_kv_blocks"] = math.ceil(int(values["max_num_seqs"]) * length / block)
        sources["num_kv_blocks"] = "unknown: room for every sequence at full context"
    budget = int(values["max_num_batched_tokens"])
    if not values.get("enable_chunked_prefill", True) and settings.kind == VLLM and budget < length:
        # vLLM computes an unchunked prompt in one step: its budget is at least the context
        # (EngineArgs._set_default_args)
        values["max_num_batched_tokens"] = length
        sources["max_num_batched_tokens"] = "vLLM: max_model_len when chunking is off"
    config = {k: values[k] for k in _CONFIG_KEYS if k in values}
    if settings.kind == LLAMACPP:
        sources.setdefault("note", "llama.cpp slots approximated by one scheduler")
    return config, {k: sources.get(k, "") for k in config}, length


def calibrate_runs(
    runs: Sequence[Run],
    stated: str | None = None,
    hardware: str | None = None,
    model: str | None = None,
    tolerance: float | None = None,
    fits: Callable[[float], bool] | None = None,
) -> TwinCalibration:
    """Infer the steps of ``runs`` (of one server, another's than servelab's, in one
    configuration), fit the twin to them all, gather its settings. With several runs the
    speed spread holds how far the server's speed moved between them (a relaunch, another
    hour of the host) as well as within each.

    ``stated``: the server's launch command or flags, secrets redacted by the caller;
    ``hardware``: the catalogue entry it ran on (for the engine's hardware defaults);
    ``fits``: the client-clock times the fit may learn from (None: all). The steps are
    still inferred from every stream and the settings from every step, as for the whole
    run, since fewer streams seen make other batches and other steps; only the step cost,
    its noise and spreads are fitted to the steps that end at a kept time, and the API's
    reported time to the requests sent at one (an out-of-sample check's fitting part).
    Where any run lacks every token's time (``LACKS_TOKEN_TIMES``), no step is inferred: the
    prices are fitted to the requests' first and last token times (``sim.fit.first_last``).
    ValueError when the runs' settings differ."""
    first = runs[0]
    settings = server_settings(first, stated)
    for other in runs[1:]:
        theirs = server_settings(other, stated)
        keys = sorted({*settings.values, *theirs.values})
        differ = ["server"] if theirs.kind != settings.kind else []
        differ += [k for k in keys if settings.values.get(k) != theirs.values.get(k)]
        if differ:
            raise ValueError(
                f"{other.path} ran another server configuration than {first.path} "
                f"({', '.join(differ)}): calibrate on runs of one configuration"
            )
    budget = settings.get("max_num_batched_tokens")
    if budget is None:
        budget = _defaults(settings.kind, hardware)[0].get("max_num_batched_tokens")
    chunked = bool(settings.get("enable_chunked_prefill", True))
    how: dict[str, Any] = {}
    if any(LACKS_TOKEN_TIMES in r.lacks for r in runs):
        from servelab.sim.fit.first_last import FIRST_AND_LAST, fit_first_and_last

        # No step can be inferred: no step ends to place the wait for the step in
        # progress by (the API time holds it).
        fit, inference = fit_first_and_last(runs, budget, chunked, fits)
        peak = int(inference["max_batch"])
        step_ends: list[list[float]] = [[] for _ in runs]
        how = {"token_times": FIRST_AND_LAST}
        ranges: dict[str, list[int]] = {}
    else:
        infs = [_inferred(r, budget, chunked, tolerance) for r in runs]
        fitted = infs
        if fits is not None:
            fitted = [
                dataclasses.replace(inf, steps=[s for s in inf.steps if fits(s.end)])
                for inf in infs
            ]
        fit = fit_steps(fitted)
        steps = [s for inf in infs for s in inf.steps]
        peak = max((sum(1 for s in st.seqs if s.sampled) for st in steps), default=1)
        step_ends = [[s.end for s in inf.steps] for inf in infs]
        inference = _merged([inf.diagnostics for inf in infs], [len(inf.steps) for inf in infs])
        ranges = _step_ranges(steps)
    config, sources, length = engine_settings(settings, peak, hardware)
    sent = runs
    if fits is not None:
        sent = [
            dataclasses.replace(
                r, records=[q for q in r.records if fits(q.actual_send)], derived={}
            )
            for r in runs
        ]
    reported = reported_api_overhead(sent, step_ends)
    api = reported if reported is not None else fit.api
    name = model or first.model or "unknown"
    kv_bytes = 1.0
    try:
        from servelab.sim.costs.model_shapes import load_model_spec

        kv_bytes = float(load_model_spec(name).kv_bytes_per_token(2))
    except ValueError:
        pass  # the pool is fixed in blocks; the bytes only size a pool from memory
    return TwinCalibration(
        server=settings.kind,
        model=name,
        engine_config=config,
        engine_sources=sources,
        max_model_len=length,
        kv_bytes_per_token=kv_bytes,
        cost=fit.coef,
        bootstrap=fit.bootstrap,
        noise=fit.noise.to_dict() if fit.noise else None,
        api_overhead_s=max(0.0, api),
        fit={
            "error_on_training_steps": fit.error,
            "rows": fit.rows,
            "rows_trimmed": fit.trimmed,
            "api_overhead": {
                "reported_median_s": reported,
                "fitted_s": fit.api,
                "used": "reported" if reported is not None else "fitted",
            },
            "inference": inference,
            "runs": len(runs),
            **how,
        },
        settings=settings.to_dict(),
        run=", ".join(str(r.path) for r in runs),
        hardware=hardware,
        speed_spread=fit.speed_spread,
        form_spread=fit.form_spread,
        tokenizer=run_tokenizer(first, name),
        domain={**domain_of([r for run in runs for r in run.records]), **ranges},
        first_steps=first_steps([r.records for r in runs], budget, config.get("max_num_seqs")),
    )


def _inferred(run: Run, budget: Any, chunked: bool, tolerance: float | None) -> StepInference:
    """``infer_steps`` of a run, kept in ``run.derived``: leave-one-run-out calibration
    (``sim.fit.held_out``) fits each run in every fold but one, and inferring its steps
    (parsing its /metrics scrapes) again each time cost seconds a run."""
    key = f"twin_steps:{budget}:{chunked}:{tolerance}"
    if key not in run.derived:
        run.derived[key] = infer_steps(
            run.records, budget, chunked=chunked, scrapes=run.scrapes, tolerance=tolerance
        )
    inference: StepInference = run.derived[key]
    return inference


def domain_of(records: Sequence[Any]) -> dict[str, list[int]]:
    """What a set of client records spans: ``prompt_tokens`` and ``output_tokens`` (lowest,
    highest over the completed requests) and ``in_flight`` (one, the most requests the client
    had outstanding at once). Empty for no completed request."""
    done = [r for r in records if r.ok and r.done is not None]
    if not done:
        return {}
    peak = most_at_once([(r.actual_send, r.done) for r in done])
    prompts = [r.input_tokens for r in done]
    outputs = [r.output_tokens for r in done]
    return {
        "prompt_tokens": [min(prompts), max(prompts)],
        "output_tokens": [min(outputs), max(outputs)],
        "in_flight": [1, peak],
    }


def most_at_once(spans: Sequence[tuple[float, float]]) -> int:
    """The most ``(start, end)`` spans open at once (one ending as another starts: not both)."""
    now = peak = 0
    for _, step in sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans]):
        now += step
        peak = max(peak, now)
    return peak


def _step_ranges(steps: Sequence[InferredStep]) -> dict[str, list[int]]:
    """The streams one inferred step served and the tokens it computed, lowest to highest."""
    if not steps:
        return {}
    batch = [sum(1 for q in s.seqs if q.sampled) for s in steps]
    tokens = [sum(q.new_tokens for q in s.seqs) for s in steps]
    return {"batch": [min(batch), max(batch)], "step_tokens": [min(tokens), max(tokens)]}


# The figures of ``domain_of`` a simulated run is checked against, with their names.
_CHECKED = (("prompt_tokens", "prompt"), ("output_tokens", "output"), ("in_flight", "in flight"))


def outside_domain(domain: dict[str, list[int]] | None, records: Sequence[Any]) -> str | None:
    """One line saying how far a simulated run's requests went beyond what the twin was
    calibrated on (``domain``: prompt and output tokens, requests in flight; the farthest
    as simulated against calibrated, each by its factor), or None when within it or the
    twin records no domain (a calibration written before it did)."""
    if not domain:
        return None
    seen = domain_of(records)
    past: list[tuple[float, str, str]] = []  # (factor, figure, what was simulated)
    for key, name in _CHECKED:
        if key not in domain or key not in seen:
            continue
        (lo, hi), (slo, shi) = domain[key], seen[key]
        if shi > hi:
            past.append((shi / max(hi, 1), name, f"{name} {shi} vs <= {hi}"))
        if slo < lo and key != "in_flight":
            past.append((lo / max(slo, 1), name, f"{name} {slo} vs >= {lo}"))
    if not past:
        return None
    past.sort(key=lambda p: -p[0])
    # the farthest in full, the others by their factor alone (the line fits 100 columns)
    line = f"warning: beyond the twin's domain: {past[0][2]} ({past[0][0]:.1f}x)"
    others = ", ".join(f"{name} {x:.1f}x" for x, name, _ in past[1:])
    return f"{line}; also {others}" if others else line


def run_tokenizer(run: Run, model: str) -> str:
    """The tokenizer that counts ``model``'s tokens as the run's server did: the one the
    bench planned with where it was the model's own (``--tokenizer``, ``--model``, the
    server's ``/tokenize``), else the model's name; never servelab's default model's
    tokenizer that stood in for an unknown one."""
    source = str(run.manifest.get("tokenizer_source") or "")
    name = run.manifest.get("tokenizer")
    if isinstance(name, str) and name and source not in ("", "default model"):
        return name
    return model


def _merged(diags: list[dict[str, Any]], weights: list[int]) -> dict[str, Any]:
    """One step-inference diagnostics dict for several runs: counts summed, maxima and
    tolerances the largest, means (and pairs of means) weighted by the runs' steps."""
    if len(diags) == 1:
        return diags[0]
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for d in diags for k in d):
        have = [(d[key], w) for d, w in zip(diags, weights) if key in d]
        vals = [v for v, _ in have]
        total = max(sum(w for _, w in have), 1)
        if all(isinstance(v, list) for v in vals):
            out[key] = [sum(v[i] * w for v, w in have) / total for i in range(len(vals[0]))]
        elif key.startswith("mean"):
            out[key] = sum(v * w for v, w in have) / total
        elif all(isinstance(v, int) for v in vals) and not key.startswith("max"):
            out[key] = sum(vals)
        else:
            out[key] = max(vals)
    return out
