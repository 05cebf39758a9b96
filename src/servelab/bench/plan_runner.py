"""Execute a plan against a target: open or closed loop, sessions, recording.

Open loop: a dispatcher sleeps until each session's intended send time and starts
it as its own task, whatever is still in flight (so a slow server shows up as
queueing, not as a slower arrival rate). Closed loop: ``concurrency`` workers each
take the next session when their previous one ends. A session's later turns go
``think_time`` after the previous response and carry the conversation so far.

Every request ends as exactly one ClientRecord handed to ``on_record``: completed,
failed, timed out, skipped (an earlier turn of its session failed) or aborted (the
run was interrupted).

Connections are opened before the stage's clock starts (``warm_connections``), unless the
target asks for cold ones (``Target.cold_connections``: each stage starts with none open, and
every new stream's set-up is part of its first TTFT). A closed loop opens one per stream; an
open loop as many as its plan sends in its busiest second, and keeps as many spare while it
runs. ``StageResult.connections`` records the set-up, apart from every request's figures.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from servelab.bench.client.http import HttpClient
from servelab.bench.client.recount import Recounter
from servelab.bench.client.send import Outcome, Target, send
from servelab.bench.workloads.request_plan import LoadSpec, PlannedRequest, compose_prompt
from servelab.vocab import ClientRecord

START_DELAY_S = 0.05  # the first intended send is this far after the run starts
WARM_WINDOW_S = 1.0  # an open loop pre-opens the connections its busiest such window sends on
MAX_WARM = 256  # ... at most this many (and keeps as many spare)


@dataclass(kw_only=True)
class StageResult:
    """What one execution did, for the manifest."""

    label: str | None
    start: float
    end: float
    sent: int
    records: list[ClientRecord]
    interrupted: bool = False
    connections: dict[str, Any] | None = None  # the set-up before the clock (warm_connections)


def sessions(plan: Iterable[PlannedRequest]) -> Iterator[list[PlannedRequest]]:
    """Group a plan into sessions (consecutive turns with one ``session_id``)."""
    current: list[PlannedRequest] = []
    for req in plan:
        session = req.tags.session_id
        if current and (session is None or session != current[0].tags.session_id):
            yield current
            current = []
        current.append(req)
    if current:
        yield current


def busiest_window(plan: list[PlannedRequest], window: float = WARM_WINDOW_S) -> int:
    """The most sessions an open-loop plan starts within any ``window`` seconds."""
    times = sorted(turns[0].send_time or 0.0 for turns in sessions(plan))
    most, lo = 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] >= window:
            lo += 1
        most = max(most, hi - lo + 1)
    return most


async def warm_connections(
    http: HttpClient, load: LoadSpec, plan: list[PlannedRequest] | None, cold: bool
) -> dict[str, Any]:
    """Open the stage's connections before its clock starts (or, ``cold``, close every idle
    one); return what was done, for the manifest."""
    if cold:
        await http.cold()
        return {"mode": "cold"}
    if load.closed:
        assert load.concurrency is not None
        n, spare = load.concurrency, 0
    else:
        n = spare = min(MAX_WARM, busiest_window(plan or []))
    return {"mode": "warm", "wanted": n, "spare": spare, **await http.warm(n, spare)}


def request_id(run_tag: str, req: PlannedRequest) -> str:
    """The id a planned request is sent and recorded under in a run tagged ``run_tag``."""
    return f"{run_tag}-{req.request_id}"


def _session_taker(
    plan: Iterable[PlannedRequest] | AsyncIterator[list[PlannedRequest]],
) -> Callable[[], Awaitable[list[PlannedRequest] | None]]:
    """The next session of a plan, or None at its end (a feed may make the caller wait)."""
    if isinstance(plan, AsyncIterator):
        feed = plan

        async def take_fed() -> list[PlannedRequest] | None:
            return await anext(feed, None)

        return take_fed
    it = sessions(plan)

    async def take() -> list[PlannedRequest] | None:
        return next(it, None)

    return take


class PlanRunner:
    """Runs one stage. ``on_send(req)``/``on_record(rec)`` feed the display, the run
    directory and a distributed worker's reports."""

    def __init__(
        self,
        http: HttpClient,
        target: Target,
        load: LoadSpec,
        *,
        run_tag: str,
        stage: str | None = None,
        on_send: Callable[[PlannedRequest], None] | None = None,
        on_record: Callable[[ClientRecord], None] | None = None,
    ) -> None:
        self.http = http
        self.target = target
        self.load = load
        self.run_tag = run_tag
        self.stage = stage
        self._on_send = on_send or (lambda req: None)
        self._on_record = on_record or (lambda r: None)
        self.records: list[ClientRecord] = []
        self.sent = 0
        # (class, prompt or messages) in send order, for the request-similarity figure
        self.prompts: list[tuple[str, str | list[dict[str, str]]]] = []
        # one queue of re-counts for all streams, so a wave of finished requests is spread;
        # a request is recorded once counted, while its stream goes on to the next one
        self._recounter = Recounter(target.tokenizer) if target.tokenizer is not None else None
        self._counting: set[asyncio.Task[None]] = set()
        self.connections: dict[str, Any] | None = None  # the set-up ``warm`` did
        self._topped = 0

    def _record(self, rec: ClientRecord) -> None:
        self.records.append(rec)
        self._on_record(rec)

    async def warm(
        self, plan: Iterable[PlannedRequest] | AsyncIterator[list[PlannedRequest]]
    ) -> None:
        """Open the stage's connections (or close the idle ones, cold) before anything times the
        stage: ``run`` does it first itself unless this was called. An open loop sizes its pool
        from ``plan``, which must then be a list."""
        self._topped = self.http.topped_up
        self.connections = await warm_connections(
            self.http,
            self.load,
            plan if isinstance(plan, list) else None,
            self.target.cold_connections,
        )

    async def run(
        self,
        plan: Iterable[PlannedRequest] | AsyncIterator[list[PlannedRequest]],
        start_at: float | None = None,
    ) -> StageResult:
        """Execute ``plan``; every request ends as one record.

        ``start_at`` (a ``time.monotonic()`` value) starts the stage then instead of now:
        the distributed workers' common start. A closed loop may also take an async
        iterator of sessions, which receives more sessions while the stage runs.
        """
        if self.connections is None:
            if not self.load.closed and not isinstance(plan, (list, AsyncIterator)):
                plan = list(plan)  # an open loop's whole plan is up front: sized once, sent once
            await self.warm(plan)
        connections = self.connections
        assert connections is not None
        start = time.monotonic() if start_at is None else start_at
        tasks: set[asyncio.Task[None]] = set()
        interrupted = False
        try:
            if start_at is not None:
                await asyncio.sleep(max(0.0, start_at - time.monotonic()))
            if self.load.closed:
                await self._closed(plan, start, tasks)
            else:
                await self._open(plan, start + START_DELAY_S, tasks)
            if tasks:
                await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            interrupted = True
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*self._counting, return_exceptions=True)  # every record is in
        if connections["mode"] == "warm":
            connections["topped_up"] = self.http.topped_up - self._topped
        return StageResult(
            label=self.stage,
            start=start,
            end=time.monotonic(),
            sent=self.sent,
            records=self.records,
            interrupted=interrupted,
            connections=connections,
        )

    async def _open(
        self,
        plan: Iterable[PlannedRequest] | AsyncIterator[list[PlannedRequest]],
        t0: float,
        tasks: set[asyncio.Task[None]],
    ) -> None:
        if isinstance(plan, AsyncIterator):
            raise TypeError("an open loop needs its whole plan up front, not a session feed")
        loop = asyncio.get_running_loop()
        for turns in sessions(plan):
            due = t0 + (turns[0].send_time or 0.0)
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = loop.create_task(self._session(turns, due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _closed(
        self,
        plan: Iterable[PlannedRequest] | AsyncIterator[list[PlannedRequest]],
        start: float,
        tasks: set[asyncio.Task[None]],
    ) -> None:
        assert self.load.concurrency is not None
        take = _session_taker(plan)
        stop_at = start + self.load.duration if self.load.duration else None

        async def worker() -> None:
            while stop_at is None or time.monotonic() < stop_at:
                turns = await take()
                if turns is None or (stop_at is not None and time.monotonic() >= stop_at):
                    return  # the end of the plan, or a feed that made this stream wait too long
                await self._session(turns, time.monotonic())

        loop = asyncio.get_running_loop()
        for _ in range(self.load.concurrency):
            task = loop.create_task(worker())
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _session(self, turns: list[PlannedRequest], intended: float) -> None:
        history: list[tuple[str, str]] = []
        failed: str | None = None
        for req in turns:
            if failed is not None:
                self._record(self._skipped(req, failed))
                continue
            if req.tags.turn > 0:
                intended = time.monotonic() + req.think_time
                if req.think_time > 0:
                    await asyncio.sleep(req.think_time)
            outcome = await self._send(req, history, intended)
            if not outcome.record.ok:
                failed = outcome.record.request_id
            # a dataset's recorded reply, where the plan keeps one; otherwise the model's own
            history.append((req.prompt, req.reply if req.reply is not None else outcome.text))

    def _rid(self, req: PlannedRequest) -> str:
        return request_id(self.run_tag, req)

    def _compose(
        self, req: PlannedRequest, history: list[tuple[str, str]]
    ) -> str | list[dict[str, str]]:
        """The prompt (or messages) for this turn: the conversation so far, then the plan's."""
        past = history if (req.tags.turn > 0 and req.carry_history) else []
        return compose_prompt(req.prompt, past, self.target.endpoint)

    async def _send(
        self, req: PlannedRequest, history: list[tuple[str, str]], intended: float
    ) -> Outcome:
        prompt = self._compose(req, history)
        self.sent += 1
        self.prompts.append((req.tags.workload_class, prompt))
        self._on_send(req)
        outcome = await send(
            self.http,
            self.target,
            req,
            prompt=prompt,
            intended_send=intended,
            request_id=self._rid(req),
            stage=self.stage,
            on_abort=self._record,
            recounter=self._recounter,
        )
        if outcome.counting is None:
            self._record(outcome.record)
        else:
            self._counting.add(outcome.counting)
            outcome.counting.add_done_callback(partial(self._counted, outcome.record))
        return outcome

    def _counted(self, rec: ClientRecord, task: asyncio.Task[None]) -> None:
        self._counting.discard(task)
        self._record(rec)  # even if its count failed: a request is never dropped

    def _skipped(self, req: PlannedRequest, failed_id: str) -> ClientRecord:
        now = time.monotonic()
        return ClientRecord.for_request(
            self._rid(req),
            req.tags,
            stage=self.stage,
            intended_send=now,
            actual_send=now,
            input_tokens=req.prompt_tokens,
            requested_output_tokens=req.max_tokens,
            error=f"skipped: turn {failed_id} of this session failed, so it was not sent",
        )
