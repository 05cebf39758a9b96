"""A run as it ran, for the simulator: its own requests and a replica priced by its own steps.

:func:`requests_as_run` rebuilds the requests a run sent through the benchmark's planner
(``bench.plan``: the manifest's workload, load, seed, endpoint and tokenizer give the same
prompts, lengths, classes, sessions, shared prefixes, priorities and streaming) and then
sets what the client really did: an open-loop first turn is sent at its measured send
(``actual_send``, so the client's own lag is replayed), a later turn of a session waits
the measured gap after the previous turn's last byte, and a resent history stops matching
the prefix cache where the run's own cache hit stopped (:mod:`servelab.sim.loop.history`), not
at a drawn place. A closed loop stays a closed loop at the run's concurrency: its first wave
is sent at the measured sends, every later request as a slot frees. Every rebuilt
request is checked against its record (same id, same output length, and for a first turn
the same prompt length): a run whose manifest cannot reproduce its requests is refused.

:func:`target_from_run` is one replica with the run's resolved engine config, its KV pool
(the steps' ``kv_blocks_total``) and a cost model fitted to its own steps
(``profiler.table_from_runs``: the profiled form with a non-decreasing token term, the
engine's overhead between steps and the step noise). The candidates run shapes the run
never had (64-token chunks after 700 cached tokens, where it only prefilled whole
prompts); a free token term fitted to one unchunked demo run charged decode batches by a
sequence term and prefill by attention pairs, and priced such chunks 1.44x what they took
when run, 1.28x with the monotone term (docs/design/tune.md).

A run of another server (vLLM, SGLang, llama.cpp: no step records, no timelines) replays
on its twin instead (:func:`replay_target`, ``sim.fit.twin.calibrate_runs``): steps inferred from
the client's chunk arrivals, a step cost fitted to them, the server's settings as it reported
them, its launch command or what the user stated. Simulator seed ``k`` runs on the twin's
``k``-th draw (bootstrap refit and speed), so a prediction's range over seeds carries what
one run could not pin down. What the timelines would give comes from the client records:
the one-way delay is half the twin's API time per request, and where a resent history left
the prefix cache from the cached tokens the server reported per request (else the run's
``/metrics`` prefix hits shared out, as the twin's step inference assumed them).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servelab.analyze.server_side.serversettings import SERVELAB
from servelab.engine.engine_config import EngineConfig
from servelab.rundir import Run
from servelab.sim.fit.twin import TwinCalibration, calibrate_runs, engine_changes
from servelab.sim.loop.history import Resend
from servelab.sim.loop.simulation import SimRequest
from servelab.sim.sim_target import SimTarget
from servelab.vocab import DEFAULT_MODEL


class NotReplayable(ValueError):
    """The run cannot be replayed; the message says why and what to do."""


@dataclass(frozen=True)
class MeasuredResend(Resend):
    """Where each later turn's resent history stopped matching the prefix cache in the run,
    by planned request id (``inf``: it matched to the end); unknown ids never diverge."""

    cuts: dict[str, float] = field(default_factory=dict)

    def cut(self, key: str) -> float:
        # requests_from_plan draws with "<draw key>:<planned request id>"
        return self.cuts.get(key.rsplit(":", 1)[-1], math.inf)


@dataclass
class AsRun:
    """The run's requests as the simulated client sends them, and how they are sent."""

    requests: list[SimRequest]
    max_concurrency: int | None
    network_delay: float
    slos: dict[str, Any]  # class -> units.SLO, the workload's
    info: dict[str, Any]  # workload spec (a dict), load, seed, endpoint, tokenizer, run tag
    # request id -> the error it failed with in the run: the replay sends it (it loaded the
    # server as run) and counts it failed, whatever the simulated server made of it
    failed: dict[str, str] = field(default_factory=dict)


def plan_inputs(run: Run) -> dict[str, Any]:
    """What the planner needs from the manifest: ``workload`` (spec dict, or ``{"trace"}``
    for a trace replay), ``load`` (dict),
    ``seed``, ``endpoint``, ``tokenizer``, ``run_tag`` and ``max_model_len``."""
    m = run.manifest
    config = m.get("config") or {}
    sim = m.get("sim") or {}
    load = run.load
    workload = run.workload
    planned = isinstance(workload, dict) and (
        "classes" in workload or load.get("trace") is not None
    )
    if not load or not planned:
        raise NotReplayable(
            f"{run.name}: the manifest does not record the workload spec and load the run "
            "was planned from, so its requests cannot be rebuilt"
        )
    trace = load.get("trace")
    if isinstance(trace, str) and (run.path / trace).is_file() and not Path(trace).is_absolute():
        # a trace kept inside the run directory (an import's): found wherever the run moved
        load = {**load, "trace": str(run.path / trace)}
    seed = config.get("seed", sim.get("seed"))
    if seed is None:
        raise NotReplayable(
            f"{run.name}: the manifest does not record the plan's seed (a simulated run "
            "written before the seed was recorded); re-run it"
        )
    return {
        "workload": workload,
        "load": load,
        "seed": int(seed),
        "endpoint": config.get("endpoint") or sim.get("endpoint") or "completions",
        "tokenizer": m.get("tokenizer") or run.model or DEFAULT_MODEL,
        "run_tag": config.get("run_tag"),
        "max_model_len": run.server.get("max_model_len"),
    }


def is_foreign(run: Run) -> bool:
    """Whether ``run`` replays on a twin: no engine step records (another server's run)."""
    return not run.steps


def check_replayable(run: Run) -> None:
    """Raise :class:`NotReplayable` for a run the simulator cannot replay as it ran."""
    if run.steps and not run.timelines:
        raise NotReplayable(
            f"{run.name} has engine step records but no server timelines (steps.jsonl without "
            "server.jsonl); re-run it with timelines"
        )
    if is_foreign(run) and not any(r.stream and r.chunk_times for r in run.records):
        raise NotReplayable(
            f"{run.name} has no engine step records and no streamed requests: the twin infers "
            "another server's steps from its streams' chunk arrivals; bench it streaming"
        )
    if len(run.stages) > 1:
        raise NotReplayable(
            f"{run.name} is a sweep of {len(run.stages)} loads; tune one load at a time "
            "(a run without --sweep)"
        )
    if len({(s.replica, s.role) for s in run.steps}) > 1:
        raise NotReplayable(
            f"{run.name} was served by several engines (replicas or disaggregated workers); "
            "tune a one-engine run"
        )


def _prefix_hits(run: Run) -> dict[str, tuple[int, int, int]]:
    """Request id -> (prompt tokens, output tokens, prompt tokens served from the prefix
    cache): from the timelines, or for another server's run from its records (what the
    server reported per request, else the ``/metrics`` hits shared out)."""
    out = {}
    if is_foreign(run):
        from servelab.analyze.server_side.stepinfer import cached_size, estimated_cached

        est = estimated_cached(run.records, run.scrapes)
        for r in run.records:
            hit = cached_size(r, est) if r.ok else None
            if hit is not None:
                out[r.request_id] = (r.input_tokens, r.output_tokens, hit)
        return out
    for r in run.records:
        tl = run.timeline_for(r)
        if tl is not None:
            hit = tl.chunks[0].cached_tokens if tl.chunks else tl.cached_tokens
            out[r.request_id] = (tl.prompt_tokens, tl.output_tokens, hit)
    return out


def _measured_cuts(run: Run, ids: dict[str, str], bs: int) -> dict[str, float]:
    """Planned id -> the answer position where the resent history left the prefix cache
    (``bs``: the KV block size)."""
    hits = _prefix_hits(run)
    by_session: dict[str, list[Any]] = {}
    for r in run.records:
        if r.session_id is not None and r.ok:
            by_session.setdefault(r.session_id, []).append(r)
    cuts: dict[str, float] = {}
    for recs in by_session.values():
        recs.sort(key=lambda r: r.turn)
        for prev, nxt in zip(recs, recs[1:], strict=False):
            a, b = hits.get(prev.request_id), hits.get(nxt.request_id)
            if a is None or b is None or nxt.request_id not in ids:
                continue
            prompt, output, hit = a[0], a[1], b[2]
            end = prompt + output - 1  # the last token has no K/V
            if hit >= end // bs * bs:
                continue  # matched to the answer's last full block
            cuts[ids[nxt.request_id]] = float(max(0, hit - prompt))
    return cuts


def requests_as_run(run: Run, tokenizer: Any = None, replica: Replica | None = None) -> AsRun:
    """The run's requests, rebuilt and set to what the client did (see the module doc).
    ``replica``: what the run replays on (``replay_target``; built here when not given)."""
    from servelab.bench.workloads.request_plan import LoadSpec, iter_plan
    from servelab.bench.workloads.spec import parse_workload
    from servelab.sim.loop.sim_requests import requests_from_plan

    check_replayable(run)
    replica = replica or replay_target(run)
    inputs = plan_inputs(run)
    spec = parse_workload(inputs["workload"]) if "classes" in inputs["workload"] else None
    load = LoadSpec(**inputs["load"])
    if tokenizer is None:
        from servelab.modelcore.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_model(inputs["tokenizer"])
    tag = inputs["run_tag"]
    records = {r.request_id: r for r in run.records}
    recorded: set[str] = set()
    plan = []
    want = len(records)
    for p in iter_plan(
        spec,
        load,
        inputs["seed"],
        tokenizer=tokenizer,
        endpoint=inputs["endpoint"],
        max_model_len=inputs["max_model_len"],
    ):
        rid = f"{tag}-{p.request_id}" if tag else p.request_id
        if rid in records:
            plan.append(p)
            recorded.add(rid)
            if len(plan) == want:
                break
        elif load.closed and len(plan) >= want:
            break
    missing = set(records) - recorded
    if missing:
        raise NotReplayable(
            f"{run.name}: the planner, given the manifest's workload, load and seed, does not "
            f"plan {len(missing)} of the {len(records)} recorded requests (e.g. "
            f"{sorted(missing)[0]}); the run's requests cannot be rebuilt"
        )
    planned_ids = {(f"{tag}-{p.request_id}" if tag else p.request_id): p.request_id for p in plan}
    bs = replica.target.engine_config.block_size
    resend = MeasuredResend(cuts=_measured_cuts(run, planned_ids, bs))
    reqs = requests_from_plan(plan, tokenizer, inputs["endpoint"], resend=resend)
    out = _as_sent(run, reqs, records, tag, load.concurrency)
    return AsRun(
        requests=out,
        max_concurrency=load.concurrency if load.closed else None,
        network_delay=_one_way_delay(run, replica),
        slos=run_slos(run),
        info={**inputs, "requests": len(out)},
        failed={
            r.request_id: str(rec.error)
            for r in out
            if not (rec := records[f"{tag}-{r.request_id}" if tag else r.request_id]).ok
        },
    )


def recorded_slos(run: Run) -> dict[str, Any]:
    """The class SLOs the run was judged by (``--slo`` merged in), as its manifest says."""
    from servelab.units import SLO

    m = run.manifest
    raw = (m.get("config") or {}).get("class_slos") or m.get("slos") or {}
    return {k: SLO.from_dict(v) for k, v in raw.items() if k != "*" and isinstance(v, dict)}


def run_slos(run: Run) -> dict[str, Any]:
    """The class SLOs the run was judged by: as its manifest recorded them, else the
    workload spec's (a trace replay without ``--slo`` has none)."""
    from servelab.bench.workloads.spec import parse_workload

    recorded = recorded_slos(run)
    workload = plan_inputs(run)["workload"]
    if recorded or "classes" not in workload:
        return recorded
    return parse_workload(workload).class_slos()


def _as_sent(
    run: Run,
    reqs: list[SimRequest],
    records: dict[str, Any],
    tag: str | None,
    concurrency: int | None,
) -> list[SimRequest]:
    """Check each rebuilt request against its record and give it the measured timing
    (``concurrency``: a closed loop's)."""
    closed = concurrency is not None
    rec_of = {r.request_id: records[f"{tag}-{r.request_id}" if tag else r.request_id] for r in reqs}
    offsets = [
        rec_of[r.request_id].intended_send - r.send_time
        for r in reqs
        if r.after is None and not closed
    ]
    start = statistics.median(offsets) if offsets else 0.0
    wrong = [
        r.request_id
        for r in reqs
        if rec_of[r.request_id].requested_output_tokens not in (None, r.max_tokens)
        or (
            r.tags.turn == 0
            and rec_of[r.request_id].ok
            and rec_of[r.request_id].input_tokens not in (0, len(r.prompt_token_ids))
        )
    ]
    if wrong:
        raise NotReplayable(
            f"{run.name}: {len(wrong)} of {len(reqs)} rebuilt requests differ from what the "
            f"run sent (e.g. {wrong[0]}: another prompt or output length); the manifest's "
            "workload, seed or tokenizer do not reproduce the run"
        )
    ids = {r.request_id for r in reqs}
    first_wave = {r.request_id for r in reqs if r.after is None}
    if closed:
        # Only the first wave's sends are the client's own; each later one waits for a slot.
        first_wave = set(sorted(first_wave, key=lambda i: rec_of[i].actual_send)[:concurrency])
        start = min((rec_of[i].actual_send for i in first_wave), default=0.0)
        # The rest queue behind the first wave, in plan order (the loop sends by time, then
        # by order given).
        rest = max((rec_of[i].actual_send - start for i in first_wave), default=0.0)
    out = []
    for r in reqs:
        rec = rec_of[r.request_id]
        if r.after is not None:
            if r.after not in ids:
                continue
            prev = rec_of[r.after]
            done = prev.done if prev.done is not None else rec.actual_send
            out.append(dataclasses.replace(r, think_time=max(0.0, rec.actual_send - done)))
        elif closed and r.request_id not in first_wave:
            out.append(dataclasses.replace(r, send_time=rest))
        else:
            out.append(dataclasses.replace(r, send_time=max(0.0, rec.actual_send - start)))
    return out


def _one_way_delay(run: Run, replica: Replica) -> float:
    """Median of send -> server arrival over the run's requests (one host, one clock); on a
    twin, half the API's own time per request."""
    if replica.twin is not None:
        return replica.twin.api_overhead_s / 2
    if run.simulated:
        return float((run.manifest.get("sim") or {}).get("network_delay_s") or 0.0)
    gaps = [
        tl.arrival - r.actual_send
        for r in run.records
        if (tl := run.timeline_for(r)) is not None and tl.arrival >= r.actual_send
    ]
    return statistics.median(gaps) if gaps else 0.0


def engine_config_of(run: Run) -> EngineConfig:
    """The run's resolved engine config, with its KV pool as its steps counted it."""
    fields = EngineConfig.__dataclass_fields__
    cfg = EngineConfig(**{k: v for k, v in run.engine_config.items() if k in fields})
    totals = [s.kv_blocks_total for s in run.steps if s.kv_blocks_total]
    if totals:
        cfg.num_kv_blocks = max(totals)
    return cfg


def acceptance_from_ratio(ratio: float, k: int) -> float:
    """The per-draft acceptance probability that gives ``ratio`` accepted drafts of those
    proposed when each of ``k`` drafts is accepted in order (the simulator's model)."""
    lo, hi = 0.0, 1.0
    for _ in range(40):  # E[accepted]/k = sum_{i<=k} a^i / k is increasing in a
        a = (lo + hi) / 2
        if sum(a**i for i in range(1, k + 1)) / k < ratio:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


def spec_acceptance(run: Run, k: int) -> float | None:
    """The run's per-draft acceptance (:func:`acceptance_from_ratio` of its accepted and
    proposed drafts); None if the run did not speculate."""
    proposed = sum(s.spec_proposed for s in run.steps)
    if proposed <= 0:
        return None
    return acceptance_from_ratio(sum(s.spec_accepted for s in run.steps) / proposed, k)


@dataclass
class Replica:
    """What a run replays on: one replica priced by its own steps, or (``twin`` set) the
    twin calibrated on it. :meth:`at` is the simulator target for one seed with a
    candidate's engine-config changes."""

    target: SimTarget  # seed 0: the run's own cost model, or the twin's point fit
    twin: TwinCalibration | None = None

    @property
    def kind(self) -> str:
        """Whose flags the server takes (``analyze.server_side.serversettings``: servelab, vllm, ...)."""
        return self.twin.server if self.twin is not None else "servelab"

    def at(self, seed: int, changes: dict[str, Any] | None = None) -> SimTarget:
        """Seed ``seed``'s target: the twin's draw ``seed`` (its bootstrap refit and speed);
        ``changes`` in engine-config names, as the server's own flags would set them
        (``sim.fit.twin.engine_changes``)."""
        if self.twin is None:
            return self.target.with_engine_args(**changes) if changes else self.target
        target = self.twin.target(seed)
        if changes and self.twin.server != SERVELAB:
            changes = engine_changes(self.twin, changes)
        return target.with_engine_args(**changes) if changes else target


def replay_target(run: Run, hardware: str | None = None) -> Replica:
    """What ``run`` replays on: its own steps' cost model, or for another server's run the
    twin calibrated on it (``hardware``: the catalogue entry it ran on, for the engine's
    hardware defaults; the CPU build's when not given)."""
    check_replayable(run)
    if not is_foreign(run):
        return Replica(target_from_run(run))
    try:
        cal = calibrate_runs([run], hardware=hardware)
    except ValueError as e:
        raise NotReplayable(f"{run.name}: the twin cannot be fitted to this run: {e}") from None
    return Replica(cal.target(0), cal)


@dataclass(frozen=True)
class Fold:
    """One held-out part of a run for the out-of-sample self-check: the run's span (first
    send to last byte) cut into ``WINDOWS`` equal windows dealt to ``folds`` parts in turn,
    this part's windows being ``index``, ``index + folds``, ... Its requests (``held_out``:
    those sent inside its windows) replay on a replica fitted only to the steps of the
    other windows (for a twin: steps inferred from every stream). Alternating windows rather than halves, so
    that every part sees the run's whole course (its start, its bursts, its drain)."""

    index: int
    folds: int
    start: float
    width: float
    held_out: frozenset[str]

    def holds(self, t: float) -> bool:
        return int((t - self.start) // self.width) % self.folds == self.index

    def fits(self, t: float) -> bool:
        return not self.holds(t)


FOLDS = 2
WINDOWS = 10


def folds(run: Run, k: int = FOLDS, windows: int = WINDOWS) -> list[Fold]:
    """The run's ``k`` held-out parts (:class:`Fold`)."""
    start = min(r.actual_send for r in run.records)
    end = max(r.done if r.done is not None else r.actual_send for r in run.records)
    width = max(end - start, 1e-9) / windows
    out = []
    for i in range(k):
        part = Fold(i, k, start, width, frozenset())
        held = frozenset(r.request_id for r in run.records if part.holds(r.actual_send))
        out.append(dataclasses.replace(part, held_out=held))
    return out


def fold_replica(
    run: Run, fold: Fold, hardware: str | None = None, stated: str | None = None
) -> Replica:
    """What the run replays on with ``fold`` held out: a replica priced by the other
    windows' steps, or the twin (``stated``: the server's launch command, as for the whole
    run's) whose steps are inferred from all the run's streams, as the whole run's twin's
    are, and whose cost is fitted to the other windows' steps only: the held-out streams
    still shaped the batches the others' steps ran in."""
    if not is_foreign(run):
        return Replica(target_from_run(run, keep=fold.fits))
    try:
        cal = calibrate_runs([run], stated=stated, hardware=hardware, fits=fold.fits)
    except ValueError as e:
        raise NotReplayable(
            f"{run.name}: the twin cannot be fitted to part of this run to check it: {e}"
        ) from None
    return Replica(cal.target(0), cal)


def target_from_run(run: Run, keep: Callable[[float], bool] | None = None) -> SimTarget:
    """One replica priced by the run's own steps (``keep``: those whose start it keeps,
    ``run_profile.table_from_runs``), with its engine config and KV pool."""
    from servelab.sim.fit.run_profile import table_from_runs
    from servelab.sim.sim_target import profile_target

    check_replayable(run)
    table = table_from_runs([str(run.path)], run.model or DEFAULT_MODEL, monotone=True, keep=keep)
    target = profile_target(table, engine_config_of(run))
    spec = target.engine_config.speculative_config
    if spec:
        a = spec_acceptance(run, int(spec.get("num_speculative_tokens", 1)))
        if a is not None:
            target = dataclasses.replace(target, spec_acceptance=a)
    return target
