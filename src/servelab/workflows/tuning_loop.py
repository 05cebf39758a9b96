"""`servelab tune RUN`: replay a run as it ran, predict each candidate setting, decide, verify.

0. **Gates** (``analyze.tuning.gates``): a run marked invalid, with more than a few percent
   failed requests, too few requests per class to decide the objective, or started on a
   prefix cache that was not flushed is refused with the reasons (``ignore_gates``: noted);
   the requests that failed replay as failures.
1. **Replay and self-check.** The run's own requests (``sim.fit.asrun``) replay through the
   simulator with its engine config and a cost model fitted to its steps -- for another
   server's run (vLLM, SGLang, llama.cpp), the twin calibrated on it, seed ``k`` on the
   twin's ``k``-th draw -- under ``seeds`` simulator seeds: that replay is what candidates
   are compared with. The check is out of sample: for each held-out part of the run
   (``sim.fit.asrun.folds``, alternating time windows) a model fitted to the other parts
   replays the run, and on the held-out part's requests every checked figure, goodput and
   SLO attainment, the objective and each candidate's target must match the measured ones
   within the tolerance or within their confidence intervals
   (``analyze.tuning.prediction.self_check``), or nothing is predicted.
   A figure the held-out parts have too few values to pin down is never passed: where the
   objective rests on it nothing is predicted, where a target does, its candidates are not
   (``ignore_gates``: predicted anyway, noted). The check costs ``FOLDS`` replays more.
2. **Predict.** The findings' levers give candidate settings (``analyze.tuning.candidates``; for
   another server only those its own flags can set); each replays the same requests under the same seeds (in ``jobs`` forked processes: the
   target and the requests are built once, before the fork). Where a finding calls for
   speculation on an embedded-engine run that did not speculate, a probe generates a
   sample of the run's requests with n-gram drafts first (``workflows.spec_probe``), and
   the target drafts and accepts as the probe measured.
3. **Decide** (``analyze.tuning.decision``): rank by the objective, one value per knob, the best
   knobs combined and simulated once more.
4. **Verify** (``verify=True``): measure the as-run config and the top three settings the
   decision ranked (``Decision.leaders``, the chosen one first) on the embedded server --
   another server relaunched from its command template, as-run flags and those plus each
   setting's in its own spelling -- over ``repeats`` repeats (``workflows.matrix``: the arms
   alternate, each repeat rotating their order). Every repeat plans fresh requests of the
   run's workload with a seed of its own (the run's seed + ``VERIFY_SEED_OFFSET`` + the
   repeat), the same for every arm of that repeat, so the arms are paired within a repeat
   and repeats are blocks; measured changes are compared with the changes predicted on
   those same requests (each repeat's as-run run replayed with every arm's setting), tested
   paired and blocked, and the top-1 is applied only above ``min_uplift``
   (``analyze.tuning.verification``).

The twin of another server's run is, by default, calibrated on the run alone (with
``server_config``, the launch command it ran with, where the run did not record it); a
twin file that ``servelab calibrate`` wrote (``calibration``, e.g. fitted on two launches
for honest ranges) replaces it (:func:`twin_replica`).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.markup import escape

from servelab.analyze.diagnosis.diagnose import diagnose
from servelab.analyze.server_side.serversettings import (
    SERVELAB,
    render_flags,
    server_kind,
    server_settings,
)
from servelab.analyze.tuning.candidates import (
    Candidate,
    RunFacts,
    for_server,
    generate,
    serve_flags,
    server_changes,
)
from servelab.analyze.tuning.decision import TOP, Judged, Objective, combine, decide, judge
from servelab.analyze.tuning.gates import gates
from servelab.analyze.tuning.prediction import (
    CHECKED,
    SLO_FIGURES,
    TOLERANCE,
    Figures,
    FigureSet,
    Prediction,
    SelfCheck,
    figures,
    self_check,
)
from servelab.analyze.tuning.result import Tuning
from servelab.analyze.tuning.shape import PER_TOKEN, run_shape
from servelab.analyze.tuning.verification import (
    AS_RUN,
    MIN_UPLIFT,
    Arm,
    Verification,
    arm_name,
    verify,
)
from servelab.bench.servers.template import HEALTH_TIMEOUT_S
from servelab.rundir import Run, load_run
from servelab.sim.fit.asrun import (
    AsRun,
    Fold,
    NotReplayable,
    Replica,
    check_replayable,
    engine_config_of,
    fold_replica,
    folds,
    is_foreign,
    replay_target,
    requests_as_run,
    run_slos,
)
from servelab.sim.fit.twin import TwinCalibration, calibrate_runs, outside_domain
from servelab.sim.loop.simulation import Topology
from servelab.sim.scenario import Scenario, simulate
from servelab.units import SLO
from servelab.vocab import DEFAULT_MODEL
from servelab.workflows.relaunch import as_run_engine, embedded_relaunch
from servelab.workflows.spec_probe import AcceptanceProbe, probe_acceptance, sample

DEFAULT_SEEDS = 5
DEFAULT_REPEATS = 2
VERIFY_SEED_OFFSET = 1000  # repeat r of --verify plans with the run's seed + this + r
# What a verify run costs beyond its requests: the benchmark's start, the model's tokenizer,
# its summary; and the servers' start (once, in parallel). Measured on this machine.
BENCH_OVERHEAD_S = 5.0
SERVER_START_S = 20.0
# Bootstrap resamples behind the measured figures' intervals (the run's and each part's).
MEASURED_N_BOOT = 400


@dataclass(frozen=True)
class TuneSpec:
    """What `servelab tune` was asked: see the command's help for each field."""

    run_dir: Path
    objective: str | None = None
    tolerance: float = TOLERANCE
    seeds: int = DEFAULT_SEEDS
    jobs: int | None = None  # processes for the simulations (None: one per CPU)
    top: int = TOP
    verify: bool = False
    repeats: int = DEFAULT_REPEATS
    out: Path | None = None  # where --verify writes its runs
    server_template: str | None = None  # another server's launch command (bench.servers.template)
    hardware: str | None = None  # what another server ran on (its engine's defaults)
    server_model: str | None = None  # the template's {model} (default: the run's tokenizer)
    health_timeout: float = HEALTH_TIMEOUT_S  # --verify: seconds for a server to come up
    trust_run_template: bool = False  # --verify may run the template the run's manifest records
    ignore_gates: bool = False  # tune a run the gates refuse (analyze.tuning.gates), noted
    min_uplift: float = MIN_UPLIFT  # --verify: the top-1's measured gain that pays
    calibration: Path | None = None  # another server's run: a twin file to predict from
    server_config: str | None = None  # another server's run: its launch command, if unrecorded


# Built before the worker processes fork, read by them (large: the requests and the target).
_SHARED: dict[str, Any] = {}


def _scenario(replica: Replica, asrun: AsRun, cand: Candidate | None, seed: int) -> Scenario:
    reqs, topo = asrun.requests, Topology()
    target = replica.at(seed, cand.engine if cand is not None else None)
    if cand is not None:
        if cand.priorities:
            reqs = [
                replace(
                    r,
                    tags=replace(
                        r.tags, priority=cand.priorities.get(r.tags.workload_class, r.tags.priority)
                    ),
                )
                for r in reqs
            ]
        if cand.replicas > 1:
            topo = Topology(replicas=cand.replicas)
    return Scenario(
        target,
        reqs,
        topo,
        asrun.network_delay,
        asrun.max_concurrency,
        asrun.slos,
        sim_seed=seed,
    )


# (key, candidate, seed, part): part -1 is the whole run on the replica fitted to all of it,
# part i the requests of the i-th held-out part on the replica fitted to the other parts.
Task = tuple[int, Candidate | None, int, int]


def _simulate_one(task: Task) -> tuple[int, int, Figures, float]:
    key, cand, seed, part = task
    asrun = _SHARED["asrun"]
    replica, held = (_SHARED["replica"], None) if part < 0 else _SHARED["parts"][part]
    res = simulate(_scenario(replica, asrun, cand, seed), keep_steps=False)
    for rec in res.records:  # a request that failed in the run fails in its replay
        if rec.request_id in asrun.failed:
            rec.error = f"failed as run: {asrun.failed[rec.request_id]}"
    recs = res.records if held is None else [r for r in res.records if r.request_id in held]
    return key, seed, figures(recs, asrun.slos).values, res.sim_duration


class _Simulator:
    """Runs (candidate, seed) simulations inline or in a forked pool."""

    def __init__(
        self,
        replica: Replica,
        asrun: AsRun,
        seeds: int,
        jobs: int,
        parts: Sequence[tuple[Replica, frozenset[str]]] = (),
    ) -> None:
        _SHARED.update(replica=replica, asrun=asrun, parts=list(parts))
        self.seeds = seeds
        self.pool: ProcessPoolExecutor | None = None
        if jobs > 1 and "fork" in mp.get_all_start_methods():
            self.pool = ProcessPoolExecutor(jobs, mp_context=mp.get_context("fork"))

    def predict(
        self, cands: Sequence[tuple[str, Candidate | None]], part: int = -1
    ) -> list[Prediction]:
        tasks = [(k, c, s, part) for k, (_, c) in enumerate(cands) for s in range(self.seeds)]
        return self._run(cands, tasks)

    def replay(self) -> tuple[Prediction, list[Prediction]]:
        """The run as it ran on the replica fitted to all of it, and on each replica fitted
        without one held-out part, that part's requests (one batch of simulations)."""
        n = len(_SHARED["parts"])
        cands: list[tuple[str, Candidate | None]] = [(AS_RUN, None)]
        cands += [(f"held-out part {i + 1}", None) for i in range(n)]
        tasks = [(k, None, s, k - 1) for k in range(n + 1) for s in range(self.seeds)]
        whole, *parts = self._run(cands, tasks)
        return whole, parts

    def _run(
        self, cands: Sequence[tuple[str, Candidate | None]], tasks: list[Task]
    ) -> list[Prediction]:
        if self.pool is not None:
            results = list(self.pool.map(_simulate_one, tasks, chunksize=1))
        else:
            results = [_simulate_one(t) for t in tasks]
        out = [
            Prediction(label, [{} for _ in range(self.seeds)], [0.0] * self.seeds)
            for label, _ in cands
        ]
        for key, seed, figs, dur in results:
            out[key].seeds[seed] = figs
            out[key].durations[seed] = dur
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
        _SHARED.clear()


def _probe_speculation(
    run: Run, findings: Sequence[Any], asrun: AsRun, objective: Objective
) -> AcceptanceProbe | None:
    """The acceptance of the run's own traffic, where a finding or a per-output-token
    objective (``shape.PER_TOKEN``) calls for speculation, the run did not speculate, and
    it ran on the embedded engine (``workflows.spec_probe``)."""
    called = any("speculative_decoding" in f.levers for f in findings)
    if not called and not objective.figure.startswith(PER_TOKEN):
        return None
    if run.simulated or is_foreign(run) or any(s.spec_proposed for s in run.steps):
        return None
    version = (run.manifest.get("server") or {}).get("version") or {}
    quantization = (version.get("engine") or {}).get("quantization") or "none"
    # the client's --temperature went in every body its class did not override
    sampling = (run.manifest.get("config") or {}).get("sampling") or {}
    reqs = sample(asrun.requests, run_temperature=sampling.get("temperature"))
    return probe_acceptance(run.model or DEFAULT_MODEL, quantization, engine_config_of(run), reqs)


def _facts(
    run: Run, asrun: AsRun, replica: Replica, probe: AcceptanceProbe | None = None
) -> RunFacts:
    prio: dict[str, int] = {}
    for r in asrun.requests:
        prio.setdefault(r.tags.workload_class, r.tags.priority)
    if replica.twin is not None:
        # the steps inferred from the streams: the most streams one of them served
        peak = int(replica.twin.fit.get("inference", {}).get("max_batch") or 1)
    else:
        peak = max((s.decode_seqs + len(s.prefill) for s in run.steps), default=1)
    config = dataclasses.asdict(replica.target.engine_config)
    return RunFacts(
        config=config,
        prompt_tokens=[r.input_tokens for r in run.records if r.ok],
        priorities=prio,
        peak_seqs=max(1, peak),
        speculated=any(s.spec_proposed for s in run.steps),
        probed_acceptance=probe.acceptance if probe is not None else None,
        **run_shape(run, config.get("max_num_seqs")),
    )


def _twin_summary(replica: Replica) -> dict[str, Any]:
    """What the report says about the twin a foreign run replays on: the server, each
    setting with its source, the fit, the API's time per request, the speed's spread."""
    cal = replica.twin
    assert cal is not None
    return {
        "server": cal.server,
        "engine_config": cal.engine_config,
        "engine_sources": cal.engine_sources,
        "settings": cal.settings,
        "cost": cal.cost,
        "fit_error": cal.fit.get("error_on_training_steps"),
        "steps": cal.fit.get("inference", {}).get("steps"),
        "api_overhead_s": cal.api_overhead_s,
        "speed_spread": cal.speed_spread,
        "bootstrap": len(cal.bootstrap),
    }


def twin_replica(run: Run, spec: TuneSpec) -> tuple[Replica, str | None]:
    """What ``run`` replays on (``sim.fit.asrun.replay_target``); for another server's run
    the twin file ``spec.calibration``, or else the twin calibrated on the run, with the
    launch command ``spec.server_config`` where given. The note: where the run's requests go
    beyond the twin file's domain. ValueError for a twin file that cannot be read, is of
    another server or of other settings than the run stated, or for either option on a run
    of servelab's engine; NotReplayable as ``replay_target``."""
    if not is_foreign(run):
        if spec.calibration is not None or spec.server_config is not None:
            raise ValueError(
                f"--calibration and --server-config are for another server's run (vLLM, "
                f"SGLang, llama.cpp); {run.name} ran on servelab's engine, whose own steps "
                "price its replay"
            )
        return replay_target(run, spec.hardware), None
    if spec.calibration is None and spec.server_config is None:
        return replay_target(run, spec.hardware), None
    check_replayable(run)
    if spec.calibration is None:
        try:
            cal = calibrate_runs([run], stated=spec.server_config, hardware=spec.hardware)
        except ValueError as e:
            raise NotReplayable(f"{run.name}: the twin cannot be fitted to this run: {e}") from None
        return Replica(cal.target(0), cal), None
    try:
        cal = TwinCalibration.load(spec.calibration)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(
            f"--calibration {spec.calibration}: not a twin file to read: {e}"
        ) from None
    kind = server_kind(run)
    if cal.server != kind:
        raise ValueError(
            f"--calibration {spec.calibration} is a twin of {cal.server}; {run.name} ran on {kind}"
        )
    ran = server_settings(run, spec.server_config)
    twin = cal.settings.get("values") or {}
    differ = [k for k in sorted(ran.values) if k in twin and ran.stated(k) not in (None, twin[k])]
    if differ:
        raise ValueError(
            f"--calibration {spec.calibration} was calibrated with other settings than "
            f"{run.name} ran with ({', '.join(differ)}): calibrate on runs of its configuration"
        )
    return Replica(cal.target(0), cal), outside_domain(cal.domain, run.records)


def _has_slos(slos: dict[str, SLO]) -> bool:
    return any(getattr(s, k) is not None for s in slos.values() for k in SLO.KEYS)


def _with_probe(replica: Replica, probe: AcceptanceProbe | None) -> Replica:
    """``replica`` drafting and accepting as the speculation probe measured."""
    if probe is None:
        return replica
    return Replica(
        replace(
            replica.target,
            spec_acceptance=probe.acceptance,
            spec_proposal_rate=probe.proposal_rate,
        )
    )


def _measured_parts(run: Run, parts: Sequence[Fold], slos: dict[str, SLO]) -> list[FigureSet]:
    """Each held-out part's figures with their confidence intervals (the check's yardstick)."""
    return [
        figures([r for r in run.records if r.request_id in f.held_out], slos, MEASURED_N_BOOT)
        for f in parts
    ]


def _checked(objective: Objective, cands: Sequence[Candidate], has_slos: bool) -> list[str]:
    """What the self-check compares: the usual figures, what the SLOs decide, the objective
    and every candidate's target."""
    names = [*CHECKED, *(SLO_FIGURES if has_slos else ()), objective.figure]
    names += [c.target[1] for c in cands]
    return list(dict.fromkeys(names))


def _refusal(check: SelfCheck, objective: Objective, spec: TuneSpec) -> tuple[str | None, str]:
    """Why nothing is predicted after the self-check (None: predictions go ahead), and a
    note. A figure that strays refuses whatever the flags; a run too small to check the
    objective (or anything) refuses unless ``ignore_gates``, which notes it instead."""
    if check.strayed:
        strayed = ", ".join(f"{r.scope} {r.name} ({r.off_by})" for r in check.strayed)
        return (
            f"the replay of the run's held-out parts, by a model fitted to the rest of it, "
            f"strays from the measured figures by more than {spec.tolerance:.0%} and beyond "
            f"their confidence intervals: {strayed}. "
            "Predictions from a model that does not match the run would not be worth reading, "
            "so none are made"
        ), ""
    short = check.too_small(objective.scope, objective.figure)
    if short is None and not any(r.verdict == "ok" for r in check.rows):
        short = "the run is too small to check its replay: no figure is pinned down in each part"
    if short is None:
        return None, ""
    if spec.ignore_gates:
        return None, f"{short}; the objective is predicted anyway (--ignore-gates)"
    return f"{short}; nothing is predicted: run it longer (--ignore-gates predicts anyway)", ""


def _decidable(
    check: SelfCheck,
    cands: list[Candidate],
    objective: Objective,
    ignore_gates: bool,
) -> tuple[list[Candidate], list[str]]:
    """The candidates, each judged on a figure the self-check could check, and the notes.
    A candidate whose own target the run cannot pin down (a class's TTFT p95 in a run
    of 30 requests a half) is judged on the objective alone, which the run does pin down
    (``_refusal`` came first), and a note says so; ``ignore_gates`` keeps the targets."""
    reasons = {c.target: why for c in cands if (why := check.too_small(*c.target))}
    if ignore_gates:
        notes = [
            f"{why} ({scope} {name}); predicted anyway (--ignore-gates)"
            for (scope, name), why in reasons.items()
        ]
        return cands, notes
    goal = (objective.scope, objective.figure)
    notes = [
        f"{why} ({scope} {name}): its candidates are judged on the objective alone"
        for (scope, name), why in reasons.items()
    ]
    return [replace(c, target=goal) if c.target in reasons else c for c in cands], notes


def predict(run: Run, spec: TuneSpec) -> Tuning:
    """Steps 1-3 of the module doc for a loaded run."""
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    d = diagnose(run)
    tuning = Tuning(run.name, findings=d.findings, seeds=spec.seeds, timings=timings)
    # The tokenizer's thread pool must not be running when the simulations fork.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        replica, note = twin_replica(run, spec)
        tuning.notes += [note] if note else []
        tuning.server = replica.kind
        if replica.twin is not None:
            tuning.twin = _twin_summary(replica)
        asrun = requests_as_run(run, replica=replica)
        objective = Objective.parse(spec.objective, _has_slos(asrun.slos))
        if objective.scope not in ("overall", *run.classes):
            raise ValueError(
                f"--objective {spec.objective}: the run has no class {objective.scope!r}; "
                f"its classes: {', '.join(run.classes)}"
            )
    except NotReplayable as e:
        tuning.refused = str(e)
        return tuning
    timings["rebuild_s"] = time.perf_counter() - t0
    # Before the simulations fork: the candidates need the acceptance in their target.
    try:
        probe = _probe_speculation(run, d.findings, asrun, objective)
    except Exception as e:  # noqa: BLE001 -- the model may not load here: speculation goes unpriced
        probe = None
        tuning.notes.append(f"speculation probe failed, so speculation is not predicted: {e}")
    if probe is not None:
        timings["probe_s"] = probe.seconds
        tuning.probe = probe.to_dict()
        tuning.notes.append(probe.describe())
        replica = _with_probe(replica, probe)
    tuning.replica = replica
    tuning.measured = figures(run.records, asrun.slos, n_boot=MEASURED_N_BOOT)
    t1 = time.perf_counter()
    try:
        parts = folds(run)
        fitted = [
            _with_probe(fold_replica(run, f, spec.hardware, spec.server_config), probe)
            for f in parts
        ]
    except NotReplayable as e:
        tuning.refused = str(e)
        return tuning
    timings["fit_parts_s"] = time.perf_counter() - t1
    cands, unpredicted = generate(
        d.findings, _facts(run, asrun, replica, probe), (objective.scope, objective.figure)
    )
    cands, unpredicted = for_server(replica.kind, cands, unpredicted)
    tag = asrun.info.get("run_tag")
    held = [frozenset(i.removeprefix(f"{tag}-") if tag else i for i in f.held_out) for f in parts]
    sim = _Simulator(
        replica, asrun, spec.seeds, spec.jobs or os.cpu_count() or 1, list(zip(fitted, held))
    )
    try:
        t1 = time.perf_counter()
        tuning.baseline, replayed = sim.replay()
        names = _checked(objective, cands, _has_slos(asrun.slos))
        measured = _measured_parts(run, parts, asrun.slos)
        tuning.check = self_check(list(zip(measured, replayed)), spec.tolerance, names)
        timings["replay_s"] = time.perf_counter() - t1
        refusal, note = _refusal(tuning.check, objective, spec)
        tuning.notes += [note] if note else []
        if refusal is not None:
            tuning.refused = refusal
            return tuning
        t2 = time.perf_counter()
        cands, notes = _decidable(tuning.check, cands, objective, spec.ignore_gates)
        tuning.notes += notes
        preds = sim.predict([(c.id, c) for c in cands])
        judged = [judge(tuning.baseline, c, p, objective) for c, p in zip(cands, preds)]
        first = decide(judged, objective, unpredicted, top=spec.top)
        combo = combine(first.ranked)
        combined = None
        if combo is not None:
            (p,) = sim.predict([(combo.id, combo)])
            combined = judge(tuning.baseline, combo, p, objective)
            judged.append(combined)
        tuning.judged = judged
        tuning.decision = decide(
            judged[: len(cands)], objective, unpredicted, combined=combined, top=spec.top
        )
        timings["predict_s"] = time.perf_counter() - t2
    finally:
        sim.close()
    timings["total_s"] = time.perf_counter() - t0
    return tuning


def run_tune(
    spec: TuneSpec, console: Console | None = None, servers: dict[str, Any] | None = None
) -> Tuning:
    """The whole job for ``spec.run_dir``; ``servers`` (``AS_RUN``/``TUNED`` -> a running
    server with ``url``, ``command`` and ``engine_args``) replaces the embedded servers that
    ``--verify`` would start."""
    console = console or Console()
    run = load_run(spec.run_dir)
    if spec.verify and servers is None:  # what cannot be relaunched: say so before predicting
        if is_foreign(run) and server_kind(run) != SERVELAB:
            server_template(run, spec.server_template, spec.trust_run_template)
        else:
            embedded_relaunch(run)
    try:
        has_slos = _has_slos(run_slos(run))
    except NotReplayable:
        has_slos = False  # predict() says why the run cannot be replayed
    objective = Objective.parse(spec.objective, has_slos)
    found = gates(run, objective.scope, objective.figure)
    refusals = [g.reason for g in found if g.refused]
    if refusals and not spec.ignore_gates:
        return Tuning(
            run.name,
            refused=f"{run.name} is not a run to tune from: "
            + "; ".join(refusals)
            + " (--ignore-gates tunes it anyway)",
            notes=[f"gate {g.name}: {g.reason}" for g in found if not g.refused],
            seeds=spec.seeds,
            gated=True,
        )
    with console.status(f"replaying {run.name} and predicting its candidates ..."):
        tuning = predict(run, spec)
    tuning.notes[:0] = [f"gate {g.name}: {g.reason}" for g in found]
    if spec.verify:
        chosen = tuning.decision.chosen if tuning.decision else None
        if chosen is None:
            tuning.notes.append("--verify: nothing to verify, no setting is predicted to pay")
        elif chosen.candidate.hardware:
            tuning.notes.append("--verify: the choice adds hardware, which one machine cannot try")
        else:
            tuning.verification = verify_choice(run, tuning, spec, console, servers)
    return tuning


# --------------------------------------------------------------------------- verify


def server_template(run: Run, given: str | None, trusted: bool = False) -> str:
    """The launch template ``--verify`` relaunches another server's run from: ``given``
    (``--server-template``), else, where ``trusted`` (``--trust-run-template``), the one the
    run's manifest recorded when servelab launched it from a template: a run directory can
    come from anyone, and its template runs any program. ValueError saying what to pass,
    with the recorded template in full, otherwise."""
    if given:
        return given
    recorded = run.server.get("template") if run.server.get("launched") else None
    if isinstance(recorded, str) and recorded:
        if "***" in recorded:
            raise ValueError(
                f"--verify: the template {run.name} was launched from carried a secret, which "
                "its manifest keeps redacted; pass the template again with --server-template"
            )
        if not trusted:
            raise ValueError(
                f"--verify would relaunch the server of {run.name} from the command template "
                f"its manifest records:\n  {recorded}\nA run directory can come from anyone "
                "and this runs whatever program it names, so it runs only with "
                "--trust-run-template; or pass --server-template"
            )
        return recorded
    raise ValueError(
        f"--verify relaunches the server of {run.name} (another server than servelab) from a "
        "command template, and the run records none: pass --server-template, e.g. "
        "--server-template 'vllm serve {model} --host {host} --port {port} {flags}'"
    )


def as_run_flags(run: Run, settings: dict[str, Any]) -> str:
    """The flags another server ran with, in its own spelling: what filled its template's
    ``{flags}`` when servelab launched it, else the settings its launch command or the user
    stated (``settings``: ``ServerSettings.to_dict()``), rendered by ``render_flags``."""
    launched = run.server.get("engine_args") if run.server.get("launched") else None
    if isinstance(launched, str):
        return launched
    kind, values, sources = settings["kind"], settings["values"], settings["sources"]
    stated = {
        k: v
        for k, v in values.items()
        if sources.get(k, "").startswith(("the launch command", "the stated"))
    }
    flags = []
    for k, v in stated.items():
        try:
            flags.append(render_flags(kind, {k: v}))
        except ValueError:
            continue  # not a launch flag of this server (the template holds the rest)
    return " ".join(f for f in flags if f)


def _bench_options(run: Run, out: Path, workload: str | None) -> Any:
    from servelab.bench.run import BenchOptions
    from servelab.bench.workloads.request_plan import LoadSpec
    from servelab.sim.fit.asrun import plan_inputs

    inputs = plan_inputs(run)
    config = run.manifest.get("config") or {}
    slo = config.get("slo")
    return BenchOptions(
        tokenizer=inputs["tokenizer"],
        workload=workload,
        load=LoadSpec(**inputs["load"]),
        slo=SLO.from_dict(slo) if slo else None,
        out=out,
        seed=inputs["seed"],
        endpoint=inputs["endpoint"],
        sampling=dict(config.get("sampling") or {}),
        slice_duration=float(config.get("slice_duration") or 10.0),
        command=["servelab", "tune", str(run.path), "--verify"],
    )


def _workload_file(run: Run, out: Path, name: str, priorities: dict[str, int]) -> str | None:
    """The run's workload spec as a file (None for a trace replay: the load names the trace)."""
    from servelab.sim.fit.asrun import plan_inputs

    spec = dict(plan_inputs(run)["workload"])
    if "classes" not in spec:
        return None
    if priorities:
        spec["classes"] = [
            {**c, "priority": priorities.get(c["name"], c.get("priority", 0))}
            for c in spec["classes"]
        ]
    path = out / "workloads" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path)


def _unflushed(runs: dict[str, list[Run]]) -> list[str]:
    """A note for each config whose later repeats ran on a prefix cache the server would not
    flush (vLLM answers ``POST /reset_prefix_cache`` only with ``VLLM_SERVER_DEV_MODE=1``):
    they were served the earlier repeats' prompts from its cache."""
    notes = []
    for name, rs in runs.items():
        said = {
            str(st.get("prefix_cache"))
            for r in rs[1:]
            for st in r.manifest.get("stages") or []
            if st.get("prefix_cache") not in (None, "", "flushed")
        }
        if said:
            notes.append(
                f"--verify: {name}'s prefix cache was not flushed before its later repeats "
                f"({'; '.join(sorted(said))}), so they found the earlier repeats' prompts "
                "cached; for vLLM, set VLLM_SERVER_DEV_MODE=1 in the template"
            )
    return notes


def verify_arms(tuning: Tuning) -> list[tuple[Arm, Candidate | None]]:
    """The as-run arm, then the decision's leaders that one machine can try (no hardware),
    the chosen one first, each with its candidate."""
    assert tuning.decision is not None and tuning.baseline is not None
    obj = tuning.decision.objective
    arms: list[tuple[Arm, Candidate | None]] = [
        (Arm(AS_RUN, "as run", tuning.baseline, (obj.scope, obj.figure)), None)
    ]
    leaders: list[Judged] = [j for j in tuning.decision.leaders(TOP) if not j.candidate.hardware]
    for k, j in enumerate(leaders, 1):
        c = j.candidate
        arms.append((Arm(arm_name(k), c.title, j.prediction, c.target), c))
    return arms


def plan_seeds(run: Run, repeats: int) -> list[int]:
    """The requests' seed of each verify repeat: fresh requests of the run's workload."""
    from servelab.sim.fit.asrun import plan_inputs

    seed = int(plan_inputs(run)["seed"] or 0)
    return [seed + VERIFY_SEED_OFFSET + r for r in range(repeats)]


def verify_estimate(run: Run, tuning: Tuning, repeats: int, servers_given: bool) -> float:
    """Seconds the verification will take: each repeat runs the as-run load for about as long
    as the run did and each candidate's as long as predicted, plus each run's and the
    servers' start."""
    as_run = run.window[1] - run.window[0]
    per_repeat = as_run + BENCH_OVERHEAD_S
    for arm, _ in verify_arms(tuning)[1:]:
        durations = arm.prediction.durations
        per_repeat += (min(durations) if durations else as_run) + BENCH_OVERHEAD_S
    return repeats * per_repeat + (0.0 if servers_given else SERVER_START_S)


def verify_choice(
    run: Run,
    tuning: Tuning,
    spec: TuneSpec,
    console: Console,
    servers: dict[str, Any] | None = None,
) -> Verification:
    """Step 4 of the module doc; ``servers`` (arm name -> a running server) replaces the ones
    it would start."""
    from servelab.sim.fit.asrun import plan_inputs
    from servelab.workflows.matrix import MatrixConfig, MatrixSpec, execute_matrix, start_servers

    arms = verify_arms(tuning)
    out = spec.out or run.path.parent / f"{run.name}-tune-verify"
    out.mkdir(parents=True, exist_ok=True)
    template, model = None, None
    if tuning.twin is not None and tuning.server != SERVELAB:
        if servers is None:
            template = server_template(run, spec.server_template, spec.trust_run_template)
            if not spec.server_template:
                console.print(
                    f"verify: relaunching from the template {run.name}'s manifest records "
                    f"(--trust-run-template):\n  {escape(template)}"
                )
        as_run_args = as_run_flags(run, tuning.twin["settings"])

        def flags(c: Candidate) -> str:  # the last flag wins
            changes = render_flags(tuning.server, server_changes(c.engine))
            return " ".join(a for a in (as_run_args, changes) if a)

    elif servers is None:
        relaunch = embedded_relaunch(run)
        model, as_run_args = relaunch.model, relaunch.flags

        def flags(c: Candidate) -> str:  # the last flag wins
            return f"{as_run_args} {serve_flags(c.engine)}".strip()

    else:
        base = as_run_engine(run)
        as_run_args = serve_flags(base)

        def flags(c: Candidate) -> str:
            return serve_flags({**base, **c.engine})

    args = {a.name: as_run_args if c is None else flags(c) for a, c in arms}
    workloads = {
        a.name: _workload_file(run, out, a.name, c.priorities if c is not None else {})
        for a, c in arms
    }
    seeds = plan_seeds(run, spec.repeats)
    est = verify_estimate(run, tuning, spec.repeats, servers is not None)
    console.print(
        f"verify: {', '.join(a.title for a, _ in arms)}: fresh requests of the run's workload "
        f"in each of {spec.repeats} repeat(s) (plan seeds {', '.join(map(str, seeds))}), the "
        f"same for every config of a repeat, in alternating order; this takes about "
        f"{est / 60:.1f} min ({est:.0f} s). Runs go to {out}."
    )
    matrix = MatrixSpec(
        [MatrixConfig(a.name, args[a.name], workloads[a.name]) for a, _ in arms],
        spec.repeats,
        model=model,  # the embedded server's: the model the run was served
        seeds=seeds,
    )
    t0 = time.perf_counter()
    own = None
    if template is not None and servers is None:
        console.print("\n".join(f"  {name}: {{flags}} = {a!r}" for name, a in args.items()))
        model = spec.server_model or plan_inputs(run)["tokenizer"]
        own = start_servers(
            args,
            out,
            model,
            console=console,
            templates=dict.fromkeys(args, template),
            health_timeout=spec.health_timeout,
        )
        servers = own
    try:
        res = execute_matrix(
            matrix, _bench_options(run, out, workloads[AS_RUN]), console, servers=servers
        )
    finally:
        for srv in (own or {}).values():
            srv.stop()
    tuning.timings["verify_s"] = time.perf_counter() - t0
    tuning.timings["verify_estimate_s"] = est
    # repeat -> arm -> run dir (``<arm>-r<repeat>``): only repeats every arm completed pair
    done: dict[int, dict[str, Path]] = {}
    for name, paths in res.runs.items():
        for p in paths:
            done.setdefault(int(p.name.rpartition("-r")[2]), {})[name] = p
    kept = sorted(r for r, by in done.items() if all(a.name in by for a, _ in arms))
    if not kept:
        raise RuntimeError(f"--verify: no repeat left a run of every configuration (see {out})")
    runs = {a.name: [load_run(done[r][a.name]) for r in kept] for a, _ in arms}
    tuning.notes += _unflushed(runs)
    obj = tuning.decision.objective if tuning.decision else None
    assert obj is not None
    fresh: list[dict[str, Prediction]] = []
    if tuning.replica is not None:
        t1 = time.perf_counter()
        try:
            with console.status("predicting every config on the requests the verification sent"):
                fresh = fresh_predictions(tuning.replica, arms, runs[AS_RUN], spec)
        except NotReplayable as e:
            tuning.notes.append(
                f"--verify: the requests it sent cannot be replayed ({e}), so its changes are "
                "compared with those predicted on the run's own requests"
            )
        tuning.timings["verify_predict_s"] = time.perf_counter() - t1
    return verify(
        [a for a, _ in arms],
        runs,
        (obj.scope, obj.figure),
        run_slos(run),
        min_uplift=spec.min_uplift,
        plan_seeds=[seeds[r] for r in kept],
        fresh=fresh,
    )


def fresh_predictions(
    replica: Replica,
    arms: Sequence[tuple[Arm, Candidate | None]],
    as_run_runs: Sequence[Run],
    spec: TuneSpec,
) -> list[dict[str, Prediction]]:
    """Per verify repeat, every arm's prediction on that repeat's own requests: the
    as-run arm's run rebuilt as it ran (``requests_as_run``) and replayed on ``replica``
    with each arm's setting, under the run's simulator seeds. Every arm of a repeat sent
    the same requests, so these are the predictions of exactly what was measured."""
    out = []
    for run in as_run_runs:
        asrun = requests_as_run(run, replica=replica)
        sim = _Simulator(replica, asrun, spec.seeds, spec.jobs or os.cpu_count() or 1)
        try:
            preds = sim.predict([(a.name, c) for a, c in arms])
        finally:
            sim.close()
        out.append({a.name: p for (a, _), p in zip(arms, preds)})
    return out
