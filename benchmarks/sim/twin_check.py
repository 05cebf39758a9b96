"""A twin of a live server checked against it by a held-out protocol that cannot flatter.

The parts the live-server benchmarks share (``twin_vllm``, ``twin_llamacpp``): a ``Peer``
says how to launch the server (a ``bench.servers.template`` command template), how the run states
its command to ``servelab bench``/``calibrate``, and how a fresh server is readied (a
warm-up, and an endpoint that empties its prefix cache where it has one). ``check`` runs
the protocol of docs/design/twin.md, "The held-out protocol (pre-registered)":

- **training**: the training case (its own seed, ``TRAIN_SEED``) on two launches of the
  server, the twin calibrated on both (so that its 80%/95% intervals come from
  leave-one-run-out error); with ``--train-plan`` the twin is instead
  ``servelab calibrate --plan`` against a launch of its own, and the training runs stay the
  reference of the naive baseline and the change error; with ``--train-plan-and-runs`` it is
  one ``servelab calibrate`` of the ladder's rungs and the training runs together;
- **held out**: every case has a seed no training run used and a freshly launched server of
  its own (``launches``), never one shared with training or another case; the case list
  must meet the protocol's minimums (``protocol_problems``: ``MIN_CASES`` cases, three
  workload shapes and two flag sets and two loads that training did not have);
- **figures**: ``PROTOCOL_FIGURES``, predicted (the median over ``--seeds`` simulator
  seeds, ``sim --calibration``'s ``prediction.json``) against measured (``metrics.json``);
- **scores** per figure over the held-out cases (``score``): the twin's MAPE, the naive
  baseline's MAPE (every held-out figure predicted to be the training runs' mean) and the
  change error (``row``), beside the targets (``TARGETS``); each stated interval's coverage
  and median width (``coverage``) beside ``COVERAGE_TARGETS``.

Beside the scores, each case's **step speed** (``step_speed``): the median of its inferred
steps' measured time over the twin's price of each, how fast that launch ran against the
fit whatever the workload. A case whose figures miss by what its steps ran off is the host's
speed at that launch, not the form of the twin (docs/design/twin.md).

Before each launch, the **host's speed** (``host_probe``): a fixed probe on the server's
CPU that reads nothing the server does, each launch's factor against the launches the twin
was fitted to, and a host-adjusted score beside the protocol's (the same twin, its step
prices scaled by each case's factor, simulated again). The protocol's score stays the
plain twin's.

It prints the per-case and summary tables (within 100 columns) and writes ``results.json``.
The server runs on CPU 1 (``SERVER_CPU``), the client on CPU 0. ``python -m
benchmarks.sim.twin_check coverage PRED_DIR:RUN_DIR ...`` reports the coverage for any
predictions and the runs they predicted.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.sim import host_probe
from servelab.bench.servers.template import TemplateServer
from servelab.sim.intervals import FIGURES, measured_figures

SERVELAB = [sys.executable, "-m", "servelab.cli"]
LENGTH_SCALE = "0.5"
TRAIN_SEED = 1
# The figures the protocol scores, in the issue's order (all of them in sim.intervals'
# FIGURES, so prediction.json states each one).
PROTOCOL_FIGURES = (
    "ttft_mean", "ttft_p50", "ttft_p90", "ttft_p99", "itl_p50", "itl_p99", "tpot_p50",
    "e2e_mean", "e2e_p99", "output_tok_s",
)  # fmt: skip
# The twin's MAPE (%) each figure must stay at or under; the other figures are reported only.
TARGETS = {"e2e_mean": 7.0, "ttft_p50": 15.0, "ttft_p99": 25.0, "tpot_p50": 10.0}
# The share of held-out figures each stated interval must cover: (at least, at most).
COVERAGE_TARGETS = {"80": (0.70, 0.90), "95": (0.88, 0.99)}
MIN_CASES = 8
IN_SAMPLE = " (in-sample)"  # a training run's mark where the twin was fitted to it
MIN_NEW_SHAPES = 3
MIN_NEW_FLAGS = 2
MIN_NEW_LOADS = 2
PLAN_MAX_PROMPT = 2048  # calibrate --plan: past the longest context a case sends (agent, 1.1k)
SERVER_CPU = 1  # the client takes CPU 0
HOST = "host"  # out/HOST: the host-adjusted twins and predictions


@dataclass(frozen=True)
class Case:
    """One run: a workload preset, its load flags (``servelab bench``'s), the server's flags
    and the seed its requests are planned from."""

    name: str
    workload: str
    load: str
    flags: str = ""
    train: bool = False
    seed: int = TRAIN_SEED

    @property
    def slug(self) -> str:
        return self.name.replace(" ", "-").replace("/", "")


@dataclass(frozen=True)
class Peer:
    """A server under test. ``template``: its launch command template (``{model}``,
    ``{host}``, ``{port}``, ``{flags}``); ``stated``: the command as the run states it,
    flags appended; ``model``/``tokenizer``: what it serves and how prompts are counted;
    ``reset``: empties its prefix cache at a URL, or None where it has no such endpoint;
    ``warm_up``: readies a fresh server (first batches are not the server predicted)."""

    name: str
    template: str
    stated: str
    model: str
    tokenizer: str
    reset: Callable[[str], None] | None
    warm_up: Callable[[str, Case, Path, Path], float]  # (url, case, run dir, logs) -> s


# ---------------------------------------------------------------- the protocol's rules


def _load_options(case: Case) -> dict[str, str]:
    """``--name value`` pairs of a case's load flags."""
    words = shlex.split(case.load)
    return {w: v for w, v in zip(words, [*words[1:], ""]) if w.startswith("--")}


def shape_of(case: Case) -> str:
    """The workload shape: the preset, and the arrival process where the load names one
    other than Poisson (bursty gamma arrivals are a shape of their own)."""
    arrival = _load_options(case).get("--arrival", "poisson")
    if arrival == "poisson":
        return case.workload
    return f"{case.workload} {arrival} {_load_options(case).get('--burstiness', '')}".strip()


def load_of(case: Case) -> str:
    """The load: ``concurrency N`` (a closed loop) or ``rate R`` (an open loop)."""
    opts = _load_options(case)
    if "--rate" in opts:
        return f"rate {opts['--rate']}"
    return f"concurrency {opts.get('--concurrency', '1')}"


def plan_seeds(max_prompt: int = PLAN_MAX_PROMPT) -> set[int]:
    """The seeds ``calibrate --plan`` plans its rungs from (the warm-up 0, rung k seed k)."""
    from servelab.workflows.calibration_plan import ladder

    return set(range(len(ladder(max_prompt, (1, 2, 4, 8)))))


def protocol_problems(
    train: Sequence[Case], held: Sequence[Case], training_seeds: set[int] | None = None
) -> list[str]:
    """What keeps ``held`` from being the protocol's held-out set against ``train``: a seed
    a training run used (``training_seeds`` adds others, e.g. ``plan_seeds()``) or another
    case's, fewer than ``MIN_CASES`` cases, fewer new workload shapes, flag sets or loads
    than the minimums (a load: one open loop among them). Empty when it meets them all."""
    used = {c.seed for c in train} | (training_seeds or set())
    problems = [f"{c.name}: seed {c.seed} was used in training" for c in held if c.seed in used]
    seeds = [c.seed for c in held]
    problems += [
        f"seed {s} is given to several cases"
        for s in sorted(set(seeds), key=seeds.index)
        if seeds.count(s) > 1
    ]
    if len(held) < MIN_CASES:
        problems.append(f"{len(held)} held-out cases, fewer than {MIN_CASES}")
    shapes = {shape_of(c) for c in held} - {shape_of(c) for c in train}
    if len(shapes) < MIN_NEW_SHAPES:
        problems.append(f"{len(shapes)} workload shapes not in training, want {MIN_NEW_SHAPES}")
    flags = {c.flags for c in held} - {c.flags for c in train}
    if len(flags) < MIN_NEW_FLAGS:
        problems.append(f"{len(flags)} flag changes, want {MIN_NEW_FLAGS}")
    loads = {load_of(c) for c in held} - {load_of(c) for c in train}
    if len(loads) < MIN_NEW_LOADS or not any(x.startswith("rate") for x in loads):
        problems.append(f"new loads {sorted(loads)}: want {MIN_NEW_LOADS}, one an open loop")
    return problems


def launches(train: Sequence[Case], held: Sequence[Case]) -> list[tuple[str, Case]]:
    """Every measured run with the label of the server launched for it alone, training
    first: no held-out case shares a process with training or with another case (a server
    keeps caches and warms up; a shared one would favour the later runs)."""
    return [(c.slug, c) for c in [*train, *held]]


def select(
    held: Sequence[Case],
    text: str,
    named: dict[str, tuple[str, ...]],
    seed_from: int | None = None,
) -> list[Case]:
    """The held-out cases ``--cases`` asks for: ``all``, a name of ``named`` (a subset) or
    case names joined by commas; with ``seed_from`` (``--held-seeds``), the k-th case of
    ``held`` planned from seed ``seed_from + k`` instead of its own (new requests for every
    case). SystemExit naming an unknown case."""
    wanted = named.get(text) or (
        tuple(c.name for c in held) if text == "all" else tuple(text.split(","))
    )
    unknown = sorted(set(wanted) - {c.name for c in held})
    if unknown:
        raise SystemExit(f"--cases: no case named {', '.join(unknown)}")
    chosen = [(k, c) for k, c in enumerate(held) if c.name in wanted]
    if seed_from is None:
        return [c for _, c in chosen]
    return [dataclasses.replace(c, seed=seed_from + k) for k, c in chosen]


def training(case: Case, runs: int) -> list[Case]:
    """The training case, and with ``runs`` 2 the same again on a relaunched server."""
    again = Case(f"{case.name} relaunched", case.workload, case.load, case.flags, True, case.seed)
    return [case, again][:runs]


# ---------------------------------------------------------------- running it


def add_check_arguments(ap: argparse.ArgumentParser, health_timeout: float) -> None:
    """The options every live twin check takes (``check``'s parameters)."""
    ap.add_argument("--seeds", type=int, default=8, help="simulator seeds per prediction")
    ap.add_argument(
        "--train-runs",
        type=int,
        default=2,
        choices=(1, 2),
        help="training runs, each on its own launch",
    )
    ap.add_argument(
        "--train-plan",
        action="store_true",
        help="fit the twin to `servelab calibrate --plan` (a launch of its own) instead of "
        "the training runs, which stay the naive baseline's reference",
    )
    ap.add_argument(
        "--train-plan-and-runs",
        action="store_true",
        help="fit the twin to the ladder's rungs and the training runs together (one "
        "`servelab calibrate` of them all; the ladder runs first unless --reuse finds it)",
    )
    ap.add_argument(
        "--held-seeds",
        type=int,
        default=None,
        metavar="FROM",
        help="plan the held-out cases from seeds FROM, FROM+1, ... instead of their own",
    )
    ap.add_argument("--health-timeout", type=float, default=health_timeout)
    ap.add_argument(
        "--reuse", action="store_true", help="calibrate and predict again on --out's real runs"
    )


def run(cmd: list[str], log: Path) -> float:
    """Run ``cmd``, its output to ``log``; returns seconds. Raises on failure."""
    t0 = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if code not in (0, 3):  # 3: complete, the client marked invalid on a loaded machine
        raise RuntimeError(f"`{shlex.join(cmd)}` exited {code}: see {log}")
    return time.perf_counter() - t0


def bench(peer: Peer, case: Case, url: str, out: Path, logs: Path) -> float:
    cmd = [
        "taskset", "-c", "0", *SERVELAB, "bench", "--url", url, "--tokenizer", peer.tokenizer,
        "--workload", case.workload, "--length-scale", LENGTH_SCALE, *shlex.split(case.load),
        "--server-config", f"{peer.stated} {case.flags}".strip(), "--out", str(out),
        "--quiet", "--seed", str(case.seed),
    ]  # fmt: skip
    return run(cmd, logs / f"bench-{out.name}.log")


def predict(case: Case, cal_path: Path, seeds: int, out: Path, logs: Path) -> float:
    eng = case.flags  # the server's own flags: `sim --calibration` reads them as it does
    cmd = [
        *SERVELAB, "sim", "--calibration", str(cal_path), "--workload", case.workload,
        "--length-scale", LENGTH_SCALE, *shlex.split(case.load), "--seed", str(case.seed),
        "--seeds", str(seeds), "--out", str(out), *(["--engine-args", eng] if eng else []),
    ]  # fmt: skip
    return run(cmd, logs / f"sim-{out.name}.log")


# ---------------------------------------------------------------- scoring


def measured(run_dir: Path) -> dict[str, float | None]:
    """Every ``FIGURES`` figure of a run's ``metrics.json`` (None where it has none)."""
    return measured_figures(json.loads((run_dir / "metrics.json").read_text()))


def compare(pred_dir: Path, run_dir: Path) -> list[dict]:
    """Per figure: the prediction (median), its range over seeds, the stated intervals,
    the measured figure, the relative error and whether the range covered it."""
    pred = json.loads((pred_dir / "prediction.json").read_text())["figures"]
    real = measured(run_dir)
    rows = []
    for name, _, _ in FIGURES:
        f = pred.get(name) or {}
        p, m = f.get("median"), real[name]
        lo, hi = f.get("interval") or (None, None)
        rows.append(
            {
                "figure": name,
                "predicted": p,
                "range": [lo, hi],
                "measured": m,
                "error": (p - m) / m if p is not None and m else None,
                "covered": m is not None and lo is not None and lo <= m <= hi,
                "intervals": f.get("intervals") or {},
            }
        )
    return rows


def predictions(pred_dir: Path) -> dict[str, float | None]:
    """Every ``FIGURES`` figure's prediction (the median over seeds) in ``prediction.json``."""
    figs = json.loads((pred_dir / "prediction.json").read_text())["figures"]
    return {name: (figs.get(name) or {}).get("median") for name, _, _ in FIGURES}


def reference(train_runs: Sequence[Path]) -> dict[str, float | None]:
    """The naive baseline's figures: each figure's mean over the training runs."""
    figs = [measured(r) for r in train_runs]
    out: dict[str, float | None] = {}
    for name, _, _ in FIGURES:
        vals = [v for f in figs if (v := f[name]) is not None]
        out[name] = statistics.fmean(vals) if vals else None
    return out


def row(
    predicted: float | None,
    measured_: float | None,
    ref: float | None,
    ref_predicted: float | None,
) -> dict[str, float | None]:
    """One held-out figure scored. ``ref``: the training runs' measured figure (the naive
    prediction); ``ref_predicted``: the twin's prediction of the training case. Relative
    errors (signed, of the measured figure): the twin's ``error`` and the naive one's
    ``naive_error``. The change from training, measured ``m / ref - 1`` and predicted
    ``p / ref_predicted - 1``, and ``change_error``, their absolute difference in
    percentage points: a twin off by one factor everywhere has none. None where a figure
    is missing or zero."""

    def rel(a: float | None, b: float | None) -> float | None:
        return a / b - 1 if a is not None and b else None

    m_change = rel(measured_, ref)
    p_change = rel(predicted, ref_predicted)
    return {
        "error": rel(predicted, measured_),
        "naive_error": rel(ref, measured_),
        "measured_change": m_change,
        "predicted_change": p_change,
        "change_error": (
            abs(p_change - m_change) * 100
            if p_change is not None and m_change is not None
            else None
        ),
    }


def _mean_abs(rows: list[dict], key: str, scale: float) -> float | None:
    vals = [abs(r[key]) * scale for r in rows if r[key] is not None]
    return statistics.fmean(vals) if vals else None


def score(results: list[dict], targets: dict[str, float] = TARGETS) -> dict[str, dict]:
    """Per ``PROTOCOL_FIGURES`` figure over the held-out cases of ``results`` (each with
    ``train`` and ``rows`` of ``row`` figures): the cases scored, the twin's and the naive
    baseline's MAPE (%), the mean change error (percentage points) and, where the figure
    has one in ``targets``, its target and whether the twin's MAPE met it."""
    out: dict[str, dict] = {}
    for name in PROTOCOL_FIGURES:
        rows = [r for c in results if not c["train"] for r in c["rows"] if r["figure"] == name]
        scored = [r for r in rows if r["error"] is not None and r["naive_error"] is not None]
        twin = _mean_abs(scored, "error", 100)
        target = targets.get(name)
        out[name] = {
            "cases": len(scored),
            "twin_mape": twin,
            "naive_mape": _mean_abs(scored, "naive_error", 100),
            "change_error_pp": _mean_abs(scored, "change_error", 1),
            "target_mape": target,
            "met": None if target is None or twin is None else twin <= target,
        }
    return out


def coverage(pairs: list[tuple[Path, Path]]) -> dict[str, dict[str, float | int | None]]:
    """How the stated intervals did on held-out runs: for each (prediction directory of
    ``sim --seeds``, the measured run directory it predicted) pair and every figure, whether
    the measured figure fell inside the range over seeds and inside each level's interval
    the twin stated (80%, 95%). Per interval: figures judged, the share covered and the
    median width relative to the median prediction."""
    seen: dict[str, list[tuple[bool, float]]] = {}
    for pred_dir, run_dir in pairs:
        for r in compare(pred_dir, run_dir):
            m, p = r["measured"], r["predicted"]
            if not m or not p:  # a figure missing or zero is not judged, as in ``score``
                continue
            spans = {"seeds range": r["range"], **r["intervals"]}
            for level, (lo, hi) in spans.items():
                if lo is not None:
                    seen.setdefault(level, []).append((lo <= m <= hi, (hi - lo) / p))
    return {
        level: {
            "figures": len(v),
            "coverage": sum(c for c, _ in v) / len(v),
            "median_width": statistics.median(w for _, w in v),
        }
        for level, v in seen.items()
    }


def coverage_met(report: dict[str, dict]) -> dict[str, bool | None]:
    """Per level of ``COVERAGE_TARGETS``: whether its coverage fell in the target band
    (None where the twin stated no such interval)."""
    out: dict[str, bool | None] = {}
    for level, (lo, hi) in COVERAGE_TARGETS.items():
        got = report.get(level, {}).get("coverage")
        out[level] = None if got is None else lo <= got <= hi
    return out


def step_speed(cal_path: Path, run_dir: Path) -> float | None:
    """The median over ``run_dir``'s usable single inferred steps of measured time over the
    twin's price (module doc); None where no step could be timed."""
    import statistics

    from servelab.analyze.server_side.stepinfer import infer_steps
    from servelab.rundir import load_run
    from servelab.sim.fit.twin import TwinCalibration, TwinCostModel, step_work

    cal = TwinCalibration.load(cal_path)
    price = TwinCostModel(cal.cost).predict
    run = load_run(run_dir)
    inf = infer_steps(
        run.records,
        cal.engine_config.get("max_num_batched_tokens"),
        chunked=bool(cal.engine_config.get("enable_chunked_prefill", True)),
        scrapes=run.scrapes,
    )
    ratios = [
        (s.end - s.start) / price(step_work(s.seqs))
        for s in inf.steps
        if s.usable and s.start is not None and not s.hidden
    ]
    return statistics.median(ratios) if ratios else None


def evaluate(
    out: Path,
    train: Sequence[Case],
    held: Sequence[Case],
    in_sample: bool,
    cal_path: Path | None = None,
    preds: Path | None = None,
) -> list[dict]:
    """Every measured case in ``out`` scored (``row``): a case's run is ``real-SLUG``, its
    prediction ``sim-SLUG`` in ``preds`` (default ``out``; a training run's: the first
    training case's, always in ``out``); the reference, the training runs' mean, and the
    twin's prediction of the training case; its step speed against the twin at
    ``cal_path`` (None: not measured). ``in_sample``: the twin was fitted to the training
    runs (their rows say so). Cases not run, or not predicted in ``preds``, are left out."""
    preds = out if preds is None else preds
    trained = [out / f"real-{c.slug}" for c in train if (out / f"real-{c.slug}").is_dir()]
    ref = reference(trained)
    ref_pred = predictions(out / f"sim-{train[0].slug}")
    results: list[dict] = []
    for case in [*train, *held]:
        real = out / f"real-{case.slug}"
        pred = out / f"sim-{train[0].slug}" if case.train else preds / f"sim-{case.slug}"
        if not real.is_dir() or not pred.is_dir():
            continue
        rows = compare(pred, real)
        for r in rows:
            r.update(row(r["predicted"], r["measured"], ref[r["figure"]], ref_pred[r["figure"]]))
        results.append(
            {
                "case": case.name + (IN_SAMPLE if case.train and in_sample else ""),
                "train": case.train,
                "seed": case.seed,
                "workload": case.workload,
                "load": case.load,
                "flags": case.flags,
                "rows": rows,
                "step_speed": step_speed(cal_path, real) if cal_path else None,
            }
        )
    return results


def summarize(
    out: Path, results: list[dict], held: Sequence[Case], preds: Path | None = None
) -> dict:
    """``results.json``'s ``score``: ``score``'s figures, the stated intervals' coverage on
    the held-out runs in ``out`` (predicted in ``preds``, default ``out``) and whether
    each met its band."""
    preds = out if preds is None else preds
    pairs = [(preds / f"sim-{c.slug}", out / f"real-{c.slug}") for c in held]
    intervals = coverage([(p, r) for p, r in pairs if r.is_dir() and p.is_dir()])
    return {
        "figures": score(results),
        "intervals": intervals,
        "intervals_met": coverage_met(intervals),
    }


# ---------------------------------------------------------------- tables


def _fmt(name: str, v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if name == "output_tok_s" else f"{v * 1e3:.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.0%}"


def render_cases(results: list[dict]) -> str:
    """Every case's figures in ``PROTOCOL_FIGURES`` order: predicted and measured (times in
    ms), the twin's and the naive baseline's error, the predicted and measured change from
    training; the training runs first, named without their in-sample mark (a line says it)."""
    lines = [
        "| case | figure | predicted | measured | twin | naive | change pred/meas |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in results:
        by_name = {r["figure"]: r for r in c["rows"]}
        for n in PROTOCOL_FIGURES:
            r = by_name[n]
            change = "-"
            if not c["train"]:
                change = f"{_pct(r['predicted_change'])}/{_pct(r['measured_change'])}"
            lines.append(
                f"| {c['case'].removesuffix(IN_SAMPLE)[:24]} | {n} | {_fmt(n, r['predicted'])} | "
                f"{_fmt(n, r['measured'])} | {_pct(r['error'])} | {_pct(r['naive_error'])} | "
                f"{change} |"
            )
    if any(c["case"].endswith(IN_SAMPLE) for c in results):
        lines.append("training runs: in-sample (the twin was fitted to them), not scored")
    return "\n".join(lines)


def render_speeds(results: list[dict]) -> str:
    """Each held-out case's step speed and host factor beside its E2E mean error: a miss
    the size of the speed's is the launch's speed, not the twin's form, and where the host
    factor follows it, the host's."""
    lines = [
        "| case | step speed (measured / twin) | host factor | E2E mean error |",
        "|---|---|---|---|",
    ]
    for c in results:
        if c["train"]:
            continue
        e2e = next(r["error"] for r in c["rows"] if r["figure"] == "e2e_mean")
        speed = "-" if c.get("step_speed") is None else f"{c['step_speed']:.2f}"
        host = "-" if c.get("host_factor") is None else f"{c['host_factor']:.2f}"
        lines.append(f"| {c['case'][:40]} | {speed} | {host} | {_pct(e2e)} |")
    return "\n".join(lines)


def render_score(figures: dict[str, dict], intervals: dict[str, dict]) -> str:
    """Per figure: the cases, the twin's and the naive MAPE, the change error and the
    target; then each interval's coverage and median width against its band."""

    def pc(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}%"

    lines = [
        "| figure | cases | twin MAPE | naive MAPE | change error | target |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in figures.items():
        target = "-"
        if s["target_mape"] is not None:
            verdict = {True: "met", False: "missed", None: "-"}[s["met"]]
            target = f"<= {s['target_mape']:.0f}% {verdict}"
        change = "-" if s["change_error_pp"] is None else f"{s['change_error_pp']:.1f} pp"
        lines.append(
            f"| {name} | {s['cases']} | {pc(s['twin_mape'])} | {pc(s['naive_mape'])} | "
            f"{change} | {target} |"
        )
    lines += ["", "| interval | figures | coverage | target | median width |"]
    lines.append("|---|---|---|---|---|")
    for level, r in intervals.items():
        band = COVERAGE_TARGETS.get(level)
        target = f"{band[0]:.0%}-{band[1]:.0%}" if band else "-"
        lines.append(
            f"| {level} | {r['figures']} | {r['coverage']:.0%} | {target} | "
            f"{r['median_width']:.0%} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- the host's speed


def earlier_probes(out: Path) -> dict[str, dict[str, float]]:
    """The host probes a previous check of ``out`` recorded (none: an empty dict)."""
    path = out / "results.json"
    if not path.is_file():
        return {}
    return dict((json.loads(path.read_text()).get("host") or {}).get("probes") or {})


def host_adjusted(
    out: Path, train: Sequence[Case], held: Sequence[Case],
    probes: dict[str, dict[str, float]], fitted: Sequence[str], cal_path: Path, seeds: int,
    logs: Path, results: list[dict],
) -> dict:  # fmt: skip
    """``results.json``'s ``host``: the probes, each launch's factor against the ``fitted``
    launches (``host_probe.factors``, also set as each result's ``host_factor``), how well
    the factors follow the held-out cases' step speeds, and the score of the twin at
    ``cal_path`` scaled by each held-out case's factor (predicted in ``out/HOST``). Without
    probes of the fitted launches: the probes only."""
    host: dict = {"probes": probes, "fitted": list(fitted)}
    fac = host_probe.factors(probes, fitted)
    if fac is None:
        return host
    host["factors"] = fac
    slugs = {c.name: c.slug for c in [*train, *held]}
    for r in results:
        r["host_factor"] = fac.get(slugs[r["case"].removesuffix(IN_SAMPLE)])
    pairs = [
        (r["host_factor"], r["step_speed"])
        for r in results
        if not r["train"] and r.get("host_factor") and r.get("step_speed")
    ]
    host["speed_correlation"] = log_correlation(pairs)
    root = out / HOST
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    scored = [c for c in held if c.slug in fac and (out / f"real-{c.slug}").is_dir()]
    for case in scored:
        twin = host_probe.write_scaled_twin(
            cal_path, fac[case.slug], root / f"twin-{case.slug}.json"
        )
        predict(case, twin, seeds, root / f"sim-{case.slug}", logs)
    if scored:
        adjusted = evaluate(out, train, scored, in_sample=True, preds=root)
        host["score"] = summarize(out, adjusted, scored, preds=root)
    return host


def log_correlation(pairs: Sequence[tuple[float, float]]) -> float | None:
    """Pearson's correlation of the logs of ``pairs`` (None under three pairs or with no
    spread)."""
    if len(pairs) < 3:
        return None
    xs = [math.log(a) for a, _ in pairs]
    ys = [math.log(b) for _, b in pairs]
    try:
        return statistics.correlation(xs, ys)
    except statistics.StatisticsError:
        return None


# ---------------------------------------------------------------- the check


def serve(
    peer: Peer, case: Case, label: str, out: Path, logs: Path, timings: dict[str, float],
    health_timeout: float, job: Callable[[str], float], probes: dict[str, dict[str, float]],
) -> None:  # fmt: skip
    """Probe the host's speed on the server's CPU into ``probes[label]``, launch a server
    with ``case``'s flags, warm it up, empty its prefix cache (the warm-up's prompts are
    not the case's) and run ``job(url)`` on it; stop it."""
    probes[label] = host_probe.measure(SERVER_CPU)
    t0 = time.perf_counter()
    server = TemplateServer(
        peer.template, logs / f"{peer.name}-{label}.log", peer.model, case.flags
    )
    try:
        asyncio.run(server.wait_healthy(timeout=health_timeout))
        timings[f"start {label}"] = time.perf_counter() - t0
        timings[f"warm-up {label}"] = peer.warm_up(server.url, case, out / f"warmup-{label}", logs)
        if peer.reset is not None:
            peer.reset(server.url)
        timings[f"run {label}"] = job(server.url)
    finally:
        server.stop()


def check(
    peer: Peer,
    train: list[Case],
    held: list[Case],
    out: Path,
    seeds: int = 8,
    health_timeout: float = 900.0,
    reuse: bool = False,
    timings: dict[str, float] | None = None,
    train_plan: bool = False,
    train_plan_and_runs: bool = False,
) -> dict:
    """Run the protocol (the module doc) and return what ``results.json`` holds. ``train``:
    the training runs, each on a server launched for it; ``held``: the held-out cases (a
    list short of the protocol's minimums runs, said and recorded as ``complete: false``;
    a seed training used is refused); ``train_plan``: fit the twin to ``calibrate --plan``;
    ``train_plan_and_runs``: fit it to the ladder's rungs and the training runs together;
    ``reuse``: calibrate and predict again on the real runs already in ``out``."""
    if train_plan and train_plan_and_runs:
        raise SystemExit("--train-plan or --train-plan-and-runs, not both")
    ladder_used = train_plan or train_plan_and_runs
    used = plan_seeds() if ladder_used else set()
    problems = protocol_problems(train, held, used)
    clashes = [p for p in problems if "seed" in p]
    if clashes:
        raise SystemExit("; ".join(clashes))
    if len(train) < 2 and not ladder_used:
        problems.append("one training run: the twin states no leave-one-run-out intervals")
    if problems:
        print("not the full protocol: " + "; ".join(problems))
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    timings = {} if timings is None else timings
    probes = earlier_probes(out) if reuse else {}

    for label, case in [] if reuse else launches(train, held):
        real = out / f"real-{case.slug}"
        serve(peer, case, label, out, logs, timings, health_timeout,
               lambda url, c=case, d=real: bench(peer, c, url, d, logs), probes)  # fmt: skip
    trained = [out / f"real-{c.slug}" for c in train if (out / f"real-{c.slug}").is_dir()]
    if not trained:
        raise SystemExit(f"no training run in {out}")
    t1 = time.perf_counter()
    stated = f"{peer.stated} {train[0].flags}".strip()
    if ladder_used:
        plan_twin = out / "plan" / "twin.json"
        if not (reuse and plan_twin.is_file()):

            def ladder(url: str) -> float:
                return run([*SERVELAB, "calibrate", "--plan", "--url", url, "--max-prompt",
                            str(PLAN_MAX_PROMPT), "--hardware", "cpu", "--server-config",
                            stated, "--out", str(out / "plan")],
                           logs / "calibrate-plan.log")  # fmt: skip

            serve(peer, train[0], "plan", out, logs, timings, health_timeout, ladder, probes)
    if train_plan:
        cal_path = plan_twin
    else:
        # a plan's directory counts as its rungs, as a user would give it to calibrate
        fitted = [out / "plan", *trained] if train_plan_and_runs else trained
        cal_path = out / ("twin-plan-and-runs.json" if train_plan_and_runs else "twin.json")
        run([*SERVELAB, "calibrate", *map(str, fitted), "--hardware", "cpu",
             "--server-config", stated, "--out", str(cal_path)], logs / "calibrate.log")  # fmt: skip
    timings["calibrate"] = time.perf_counter() - t1

    for case in [train[0], *(c for c in held if (out / f"real-{c.slug}").is_dir())]:
        pred = out / f"sim-{case.slug}"
        shutil.rmtree(pred, ignore_errors=True)  # reuse predicts again
        timings[f"predict {case.name}"] = predict(case, cal_path, seeds, pred, logs)
    results = evaluate(out, train, held, in_sample=not train_plan, cal_path=cal_path)
    fitted = (["plan"] if ladder_used else []) + ([] if train_plan else [c.slug for c in train])
    host = host_adjusted(out, train, held, probes, fitted, cal_path, seeds, logs, results)
    timings["total_s"] = time.perf_counter() - t_start
    summary = summarize(out, results, held)
    intervals = summary["intervals"]
    protocol = {
        "complete": not problems,
        "problems": problems,
        "training": (
            "calibrate --plan"
            if train_plan
            else f"the ladder's rungs and {len(trained)} training runs"
            if train_plan_and_runs
            else f"{len(trained)} training runs"
        ),
        "train_seeds": sorted({c.seed for c in train} | used),
        "held_out": [asdict(c) for c in held],
        "length_scale": float(LENGTH_SCALE),
        "sim_seeds": seeds,
    }
    doc = {
        "protocol": protocol, "results": results, "score": summary, "host": host,
        "timings": timings,
    }  # fmt: skip
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    print(render_cases(results))
    print()
    print(render_speeds(results))
    print()
    print(render_score(summary["figures"], intervals))
    if host.get("score"):
        print("\nhost-adjusted (each case's twin scaled by its host factor; not the score):")
        print(render_score(host["score"]["figures"], host["score"]["intervals"]))
    print("timings (s):", json.dumps({k: round(v, 1) for k, v in timings.items()}))
    return doc


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.sim.twin_check coverage PRED_DIR:RUN_DIR ...``: the coverage
    and width report."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    cov = sub.add_parser("coverage", help="intervals' coverage on held-out runs")
    cov.add_argument("pairs", nargs="+", help="PRED_DIR:RUN_DIR (a sim --seeds run, the real run)")
    args = ap.parse_args(argv)
    pairs = []
    for text in args.pairs:
        pred, sep, real = text.partition(":")
        if not sep or not (Path(pred) / "prediction.json").is_file():
            ap.error(f"{text!r}: write PRED_DIR:RUN_DIR, PRED_DIR holding prediction.json")
        if not (Path(real) / "metrics.json").is_file():
            ap.error(f"{text!r}: {real} holds no metrics.json")
        pairs.append((Path(pred), Path(real)))
    report = coverage(pairs)
    print("| interval | figures | coverage | median width |")
    print("|---|---|---|---|")
    for level, r in report.items():
        print(f"| {level} | {r['figures']} | {r['coverage']:.0%} | {r['median_width']:.0%} |")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
