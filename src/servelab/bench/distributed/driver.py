"""The driver: one schedule, run by many workers, recorded in one place.

``WorkerPool.start(n, target, ray_address=...)`` starts ``n`` workers (local processes,
or Ray actors) once per benchmark run; ``pool.run_stage(plan, load, ...)`` runs one
stage on them and returns a ``DistributedStage`` (the usual ``StageResult`` with every
record on the driver's clock, the aggregate client verdict, and the manifest report).

Invariants:

- **One plan.** The driver plans the stage; ``partition.partition`` deals whole sessions
  to the workers (by their share of a closed loop's concurrency, evenly in an open
  loop), so the union of the sub-plans is the plan and a session never spans workers.
  A closed loop bounded only by time has no end to deal: the driver feeds each worker
  sessions in plan order while it runs, keeping ``FEED_AHEAD`` per stream queued there.
- **One start, one clock.** Each worker's clock offset is measured (``clock``) before
  the stage and again after it (drift). All workers start at one moment of the driver's
  clock, converted to theirs; each record is converted back to the driver's clock
  before it is written.
- **Records as they finish.** Workers stream sends and records back as they happen; the
  driver hands each record to ``on_record`` (which appends it to ``requests.jsonl``) at
  once. Nothing waits for the end of the stage.
- **Valid only if every worker was.** Each worker keeps its own self-check; the stage's
  verdict lists every worker's reasons, plus a late start, a starved feed, or a lost
  worker.
- **A lost worker loses only its part.** When a worker dies (or its stage fails), every
  request of its share without a record is recorded as a ``worker_lost`` client error
  (saying whether it was in flight), the stage is marked incomplete with the share of
  the plan lost, and everything recorded before stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from servelab.bench.client.monitor import MAX_SEND_LAG_P99_S, ClientHealth
from servelab.bench.client.send import Target
from servelab.bench.distributed.clock import ClockOffset, measure_offset, timing_error_budget
from servelab.bench.distributed.messages import (
    DONE,
    FAILED,
    RECORDS,
    SENT,
    StageDone,
    StageJob,
    WorkerInfo,
    WorkerLost,
)
from servelab.bench.distributed.partition import (
    concurrency_over_time,
    partition,
    split_concurrency,
)
from servelab.bench.plan_runner import START_DELAY_S, StageResult, request_id, sessions
from servelab.bench.workloads.request_plan import LoadSpec, PlannedRequest
from servelab.vocab import ClientRecord

START_LEAD_S = 0.3  # the common start: this long after the last worker is ready (+ round trips)
STOP_GRACE_S = 10.0  # on an interrupt, how long the workers get to send their last records
DRIFT_SAMPLES = 8
FEED_AHEAD = (2, 4)  # sessions queued per stream of a fed worker: top up below 2, up to 4
FEED_WAIT_SHARE = 0.01  # a fed worker's streams may wait this share of the stage for sessions


class WorkerHandle(Protocol):
    """What the driver needs of a worker, local or on Ray (``local``, ``ray_workers``)."""

    kind: str
    info: WorkerInfo
    lost: str | None

    @property
    def alive(self) -> bool: ...

    def describe(self) -> str: ...

    async def ping(self) -> tuple[float, str | None]: ...

    async def setup(self, job: StageJob) -> None: ...

    async def feed(self, sessions: list[list[PlannedRequest]], end: bool = False) -> None: ...

    async def start(self, at: float) -> None: ...

    async def stop(self) -> None: ...

    def events(self) -> AsyncIterator[list[tuple[str, Any]]]: ...

    async def close(self) -> None: ...


@dataclass
class DistributedStage:
    """One stage run by the pool: records on the driver's clock, verdict, manifest report."""

    result: StageResult
    health: ClientHealth
    report: dict[str, Any]


@dataclass(kw_only=True)
class _Part:
    """One worker's part of one stage, as the driver tracks it."""

    worker: WorkerHandle
    clock: ClockOffset
    concurrency: int | None
    planned: dict[str, PlannedRequest] = field(default_factory=dict)  # handed over, no record yet
    assigned: int = 0
    sent_at: dict[str, float] = field(default_factory=dict)  # in flight: driver-clock send time
    sent: int = 0
    recorded: int = 0
    sessions_given: int = 0
    sessions_done: int = 0
    feed_closed: bool = False
    done: StageDone | None = None
    lost: str | None = None
    lost_at: float | None = None
    lost_records: int = 0
    failure: str | None = None  # the worker's traceback when its stage raised

    def assign(self, run_tag: str, reqs: Iterable[PlannedRequest]) -> None:
        for req in reqs:
            self.planned[request_id(run_tag, req)] = req
            self.assigned += 1


def _to_driver_clock(rec: ClientRecord, clock: ClockOffset) -> ClientRecord:
    off = clock.applied_offset_s
    if off == 0.0:
        return rec
    rec.intended_send -= off
    rec.actual_send -= off
    if rec.first_byte is not None:
        rec.first_byte -= off
    if rec.done is not None:
        rec.done -= off
    rec.chunk_times = [t - off for t in rec.chunk_times]
    return rec


class WorkerPool:
    """Workers kept for a whole benchmark run (every stage of a sweep uses them)."""

    def __init__(
        self,
        workers: list[WorkerHandle],
        target: Target,
        mode: str,
        address: str | None = None,
        disconnect: Callable[[], None] | None = None,
    ) -> None:
        self.workers = workers
        self.target = target
        self.mode = mode
        self.address = address
        self._disconnect = disconnect
        self.lost: list[str] = []  # every worker lost so far, and how
        self.stamping: str | None = None

    @classmethod
    async def start(
        cls, n: int, target: Target, *, ray_address: str | None = None, tag: str = ""
    ) -> WorkerPool:
        """Start ``n`` local worker processes, or ``n`` Ray actors with ``ray_address``."""
        if n < 1:
            raise ValueError(f"--workers must be >= 1, got {n}")
        if ray_address is not None:
            from servelab.bench.distributed.ray_workers import start_ray_workers

            actors, disconnect = await start_ray_workers(n, target, ray_address, tag)
            return cls(list(actors), target, "ray", ray_address, disconnect)
        from servelab.bench.distributed.local import ProcessWorker

        started = await asyncio.gather(
            *(ProcessWorker.spawn(i, target) for i in range(n)), return_exceptions=True
        )
        workers = [w for w in started if isinstance(w, ProcessWorker)]
        errors = [e for e in started if isinstance(e, BaseException)]
        if errors:
            await asyncio.gather(*(w.close() for w in workers))
            raise RuntimeError(f"could not start {n} local bench workers: {errors[0]}")
        return cls(list(workers), target, "processes")

    def describe(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "address": self.address,
            "workers": [w.describe() for w in self.workers],
            "lost": self.lost,
        }

    async def run_stage(
        self,
        plan: list[PlannedRequest] | Iterator[PlannedRequest],
        load: LoadSpec,
        *,
        run_tag: str,
        stage: str | None = None,
        on_send: Callable[[], None] | None = None,
        on_record: Callable[[ClientRecord], None] | None = None,
    ) -> DistributedStage:
        """Run one stage (a list: the whole plan; an iterator: a closed loop bounded by
        time); ``on_send``/``on_record`` are called on the driver as workers report."""
        run = _StageRun(self, plan, load, run_tag, stage, on_send, on_record)
        out = await run.run()
        self.lost += [p.lost for p in run.parts if p.lost]
        self.stamping = next((p.done.stamping for p in run.parts if p.done), self.stamping)
        return out

    async def close(self) -> None:
        try:
            await asyncio.gather(*(w.close() for w in self.workers), return_exceptions=True)
        finally:
            if self._disconnect is not None:
                self._disconnect()


class _StageRun:
    def __init__(
        self,
        pool: WorkerPool,
        plan: list[PlannedRequest] | Iterator[PlannedRequest],
        load: LoadSpec,
        run_tag: str,
        stage: str | None,
        on_send: Callable[[], None] | None,
        on_record: Callable[[ClientRecord], None] | None,
    ) -> None:
        self.pool = pool
        self.plan = plan
        self.load = load
        self.run_tag = run_tag
        self.stage = stage
        self.on_send = on_send or (lambda: None)
        self.on_record = on_record or (lambda r: None)
        self.fed = not isinstance(plan, list)
        if self.fed and not load.closed:
            raise ValueError("an open loop needs its whole plan (a list), not an iterator")
        self._sessions: Iterator[list[PlannedRequest]] | None = sessions(plan) if self.fed else None
        self._sessions_over = False
        self.parts: list[_Part] = []
        self.records: list[ClientRecord] = []
        self.start_at = 0.0

    # ------------------------------------------------------------------ the stage

    async def run(self) -> DistributedStage:
        workers = [w for w in self.pool.workers if w.alive]
        if not workers:
            raise RuntimeError("every bench worker has been lost; nothing can run this stage")
        conc = (
            split_concurrency(self.load.concurrency, len(workers))
            if self.load.concurrency is not None
            else None
        )
        workers = workers[: len(conc)] if conc else workers
        try:
            clocks = await asyncio.gather(*(measure_offset(w.ping) for w in workers))
            self.parts = [
                _Part(worker=w, clock=c, concurrency=conc[i] if conc else None)
                for i, (w, c) in enumerate(zip(workers, clocks, strict=True))
            ]
            await self._hand_out()
        except WorkerLost as e:
            raise RuntimeError(f"a bench worker was lost before the stage began: {e}") from None
        self.start_at = time.monotonic() + START_LEAD_S + 4 * max(c.rtt_min_s for c in clocks)
        started = await asyncio.gather(
            *(p.worker.start(p.clock.to_worker(self.start_at)) for p in self.parts),
            return_exceptions=True,
        )
        for outcome in started:  # a worker lost here is found and recorded by its pump
            if isinstance(outcome, BaseException) and not isinstance(outcome, WorkerLost):
                raise outcome
        tasks = [asyncio.get_running_loop().create_task(self._pump(p)) for p in self.parts]
        interrupted = False
        try:
            await asyncio.wait(tasks)
        except asyncio.CancelledError:
            interrupted = True
            await self._stop(tasks)
        end = time.monotonic()
        await self._measure_drift()
        return self._result(end, interrupted)

    async def _hand_out(self) -> None:
        """Set every worker up with its share (or its first sessions, when fed)."""
        if self.fed:
            shares: list[list[PlannedRequest]] = [[] for _ in self.parts]
        else:
            assert isinstance(self.plan, list)
            weights = [p.concurrency or 1 for p in self.parts]
            shares = partition(self.plan, weights)
        jobs = []
        for p, share in zip(self.parts, shares, strict=True):
            p.assign(self.run_tag, share)
            load = replace(self.load, concurrency=p.concurrency) if self.load.closed else self.load
            jobs.append(
                StageJob(
                    load=load, run_tag=self.run_tag, stage=self.stage, share=share, fed=self.fed
                )
            )
        await asyncio.gather(*(p.worker.setup(j) for p, j in zip(self.parts, jobs, strict=True)))
        if self.fed:
            await asyncio.gather(*(self._top_up(p) for p in self.parts))

    async def _top_up(self, p: _Part) -> None:
        """Keep a fed worker's queue between FEED_AHEAD sessions per stream; close it at the end."""
        assert self._sessions is not None and p.concurrency is not None
        if p.feed_closed or p.lost is not None:
            return
        low, high = (k * p.concurrency for k in FEED_AHEAD)
        queued = p.sessions_given - p.sessions_done
        if queued >= low and not self._sessions_over:
            return
        batch: list[list[PlannedRequest]] = []
        while not self._sessions_over and queued + len(batch) < high:
            turns = next(self._sessions, None)
            if turns is None:
                self._sessions_over = True
            else:
                batch.append(turns)
        if not batch and not self._sessions_over:
            return
        for turns in batch:
            p.assign(self.run_tag, turns)
        p.sessions_given += len(batch)
        p.feed_closed = self._sessions_over
        await p.worker.feed(batch, self._sessions_over)

    async def _pump(self, p: _Part) -> None:
        """Take one worker's events until its stage ends or it is lost."""
        try:
            async for batch in p.worker.events():
                for kind, item in batch:
                    if kind == SENT:
                        for rid, t in item:
                            p.sent_at[rid] = p.clock.to_driver(t)
                            p.sent += 1
                            self.on_send()
                    elif kind == RECORDS:
                        for rec in item:
                            self._record(p, rec)
                    elif kind == DONE:
                        p.done = item
                    elif kind == FAILED:
                        p.failure = item
                        last = item.strip().splitlines()[-1] if item.strip() else "an error"
                        p.lost = f"{p.worker.describe()} failed: {last}"
                if self.fed and p.done is None and p.lost is None:
                    await self._top_up(p)
        except WorkerLost as e:
            p.lost = str(e)
        if p.done is None and p.lost is None:
            p.lost = f"{p.worker.describe()} ended the stage without finishing it"
        if p.lost is not None:
            p.lost_at = time.monotonic()
            self._record_lost(p)

    def _record(self, p: _Part, rec: ClientRecord) -> None:
        rec = _to_driver_clock(rec, p.clock)
        p.sent_at.pop(rec.request_id, None)
        req = p.planned.pop(rec.request_id, None)
        p.recorded += 1
        if req is not None and req.tags.turn == req.num_turns - 1:
            p.sessions_done += 1
        self.records.append(rec)
        self.on_record(rec)

    def _record_lost(self, p: _Part) -> None:
        """Every request of a lost worker's share without a record becomes a client error.

        A fed worker's queued sessions that it never began are not part of a fixed plan
        (the loop is bounded by time), so only its requests in flight are recorded."""
        now = time.monotonic()
        strict = self.pool.target.strict_openai
        for rid, req in p.planned.items():
            sent = p.sent_at.get(rid)
            if self.fed and sent is None:
                continue
            if req.send_time is not None and req.tags.turn == 0 and not self.load.closed:
                intended = self.start_at + START_DELAY_S + req.send_time
            else:
                intended = sent if sent is not None else now
            what = "while it was in flight" if sent is not None else "before sending it"
            rec = ClientRecord.for_request(
                rid,
                req.tags,
                stage=self.stage,
                intended_send=intended,
                actual_send=sent if sent is not None else intended,
                input_tokens=req.prompt_tokens,
                requested_output_tokens=None if strict else req.max_tokens,
                error=f"worker_lost: {p.lost} {what}",
            )
            p.lost_records += 1
            self.records.append(rec)
            self.on_record(rec)
        p.planned.clear()
        p.sent_at.clear()

    async def _stop(self, tasks: list[asyncio.Task[None]]) -> None:
        """Interrupted: workers abort what is in flight and report it, within a grace time."""
        for p in self.parts:
            if p.done is None and p.lost is None:
                with contextlib.suppress(WorkerLost, RuntimeError, asyncio.TimeoutError):
                    await asyncio.wait_for(p.worker.stop(), STOP_GRACE_S)
        _, pending = await asyncio.wait(tasks, timeout=STOP_GRACE_S)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _measure_drift(self) -> None:
        for p in self.parts:
            if p.lost is not None:
                continue
            with contextlib.suppress(WorkerLost, RuntimeError):
                after = await measure_offset(p.worker.ping, DRIFT_SAMPLES)
                p.clock.drift_s = after.offset_s - p.clock.offset_s

    # ------------------------------------------------------------------ results

    def _lost(self) -> dict[str, Any] | None:
        lost = [p for p in self.parts if p.lost is not None]
        if not lost:
            return None
        n = sum(p.lost_records for p in lost)
        if self.fed:
            # bounded by time: the lost workers' streams for the rest of the stage
            dur = self.load.duration or 0.0
            stop_at = self.start_at + dur
            total = self.load.concurrency or 1
            share = sum(
                (p.concurrency or 0) / total * max(0.0, stop_at - (p.lost_at or stop_at)) / dur
                for p in lost
                if dur > 0
            )
        else:
            share = n / max(1, sum(p.assigned for p in self.parts))
        return {
            "workers": [p.lost for p in lost],
            "requests": n,
            "share": share,
            "errors": [p.failure for p in lost if p.failure],
        }

    def _health(self, lost: dict[str, Any] | None, wall: float) -> ClientHealth:
        done = [p for p in self.parts if p.done is not None]
        hs = [p.done.health for p in done if p.done is not None]

        def p99(d: dict[str, Any]) -> float:
            return d.get("p99") or 0.0

        h = ClientHealth(
            loop_lag=max((x.loop_lag for x in hs), key=p99, default={}),
            cpu_seconds=sum(x.cpu_seconds for x in hs),
            wall_seconds=max((x.wall_seconds for x in hs), default=0.0),
            cpu_utilisation=max((x.cpu_utilisation for x in hs), default=0.0),
            send_lag=max((x.send_lag for x in hs), key=p99, default={}),
        )
        for p in done:
            assert p.done is not None
            who = p.worker.describe()
            h.reasons += [f"{who}: {r}" for r in p.done.health.reasons]
            if p.done.late_start_s > MAX_SEND_LAG_P99_S:
                h.reasons.append(
                    f"{who}: started {p.done.late_start_s * 1e3:.0f} ms after the common start "
                    "(it got the start too late; a busy driver or slow network)"
                )
            if p.concurrency and p.done.feed_wait_s > FEED_WAIT_SHARE * p.concurrency * wall:
                h.reasons.append(
                    f"{who}: its streams waited {p.done.feed_wait_s:.2f} s in all for sessions "
                    "from the driver, which fell behind"
                )
        if lost is not None:
            h.reasons.append(
                f"incomplete: {len(lost['workers'])} worker(s) lost ({'; '.join(lost['workers'])})"
                f": {lost['share']:.1%} of the plan was lost ({lost['requests']} requests recorded "
                "as worker_lost errors); everything recorded before is kept"
            )
        h.valid = not h.reasons
        return h

    def _result(self, end: float, interrupted: bool) -> DistributedStage:
        lost = self._lost()
        health = self._health(lost, end - self.start_at)
        clocks = [p.clock for p in self.parts]
        result = StageResult(
            label=self.stage,
            start=self.start_at,
            end=end,
            sent=sum(p.sent for p in self.parts),
            records=self.records,
            interrupted=interrupted,
        )
        report = {
            "mode": self.pool.mode,
            "address": self.pool.address,
            "start": self.start_at,
            "end": end,
            "complete": lost is None and not interrupted,
            "lost": lost,
            "workers": [
                {
                    "worker": p.worker.describe(),
                    "index": p.worker.info.index,
                    "pid": p.worker.info.pid,
                    "host": p.worker.info.host,
                    "concurrency": p.concurrency,
                    "assigned": p.assigned,
                    "sent": p.sent,
                    "recorded": p.recorded,
                    "clock": p.clock.to_dict(),
                    "client": p.done.health.to_dict() if p.done else None,
                    "late_start_s": p.done.late_start_s if p.done else None,
                    "feed_wait_s": p.done.feed_wait_s if p.done else None,
                    "lost": p.lost,
                }
                for p in self.parts
            ],
            "concurrency": {
                "target": self.load.concurrency,
                **concurrency_over_time(self.records, self.start_at, end),
            },
            "timing_error_budget_s": timing_error_budget(health.loop_lag.get("p99"), clocks),
        }
        return DistributedStage(result, health, report)


def report_line(report: dict[str, Any]) -> str:
    """A stage's distributed report in one console line: workers, concurrency, clocks, loss."""
    ws = report["workers"]
    conc = report["concurrency"]
    target = f" (target {conc['target']})" if conc["target"] else ""
    measured = max(w["clock"]["uncertainty_s"] for w in ws)
    applied = max(w["clock"]["applied_uncertainty_s"] for w in ws)
    clock = (
        "one shared clock"
        if all(w["clock"]["applied_offset_s"] == 0.0 for w in ws)
        else f"clock offsets known to +/-{applied * 1e3:.2f} ms"
    )
    lost = report["lost"]
    tail = f"; LOST {lost['share']:.1%} of the plan" if lost else ""
    return (
        f"{len(ws)} {report['mode']}: in flight mean {conc['mean']:.1f}{target}, max "
        f"{conc['max']}; {clock} (measured to +/-{measured * 1e6:.0f} us){tail}"
    )
