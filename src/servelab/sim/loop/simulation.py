"""The discrete-event loop: clients, a network, a router and engine replicas in virtual time.

Each replica is the engine's own ``LLMEngine`` (its scheduler and KV cache unchanged)
over a :class:`~servelab.sim.costs.executor.SimExecutor` with its own virtual clock. The loop
always advances whichever comes first: the next client/network event, or the step of
the busy replica whose clock is furthest behind. So every replica sees requests at the
moment they reach it, and a router sees the replicas as of that moment.

Invariants:
- Client times = server times + the one-way ``network_delay`` (each way); the client
  sends at its intended time unless ``max_concurrency`` requests are in flight, then
  when one finishes (closed loop).
- A request that the engine rejects (``add_request`` raises ValueError) becomes a
  client record with status 400 and the engine's message, as a real server answers.
- Disaggregated: a request is prefilled on a prefill replica (``max_tokens=1``; the
  client gets that first token), its KV crosses ``link`` (``prompt tokens x KV bytes``
  per device), then a decode replica, whose executor is told the prompt's KV is
  already there, produces the rest. The two server timelines are merged into one.
- A replica's serving path (``SimExecutor.serving_path``, the server around its engine)
  delays each request's arrival at the engine by its inbound time and each streamed chunk
  by ``output_steps`` of the replica's step before the one that made it (the engine's
  pace: a step's output is processed while the next step runs, and a prefill step is
  followed by decode steps like the one before it), never before the request's previous
  chunk; without one, chunks reach the client when their step ends. Of the requests that
  reach an idle deployment at one instant, ``ServingPath.first_step`` of them (for their
  prompts' mean length and the deployment's sequence cap; which ones, the seed draws) go to
  the engine then and the rest an instant later, after its first step has started.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import random
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Any

from servelab.engine.request import RequestOutput
from servelab.engine.routing import Router, make_router
from servelab.engine.sampling_params import SamplingParams
from servelab.sim.costs.executor import SimExecutor, VirtualClock
from servelab.sim.loop.links import Link
from servelab.vocab import (
    COLOCATED,
    DECODE_ROLE,
    PREFILL_ROLE,
    ClientRecord,
    FinishReason,
    RequestTags,
    RequestTimeline,
    StepRecord,
)

# Virtual time starts here rather than at 0, so that no timestamp is falsy.
T0 = 1000.0


@dataclass
class SimRequest:
    """One request of the simulated client.

    ``send_time`` is the intended send, seconds from the start of the run. With
    ``after`` (a multi-turn session), the request is sent ``think_time`` after that
    request's last byte, in the same concurrency slot. ``tags`` come from the plan and
    reach the client record unchanged; without ``tags.stream`` the client sees one chunk
    carrying every token, at the last byte.
    """

    request_id: str
    send_time: float
    prompt_token_ids: list[int]
    max_tokens: int
    _: KW_ONLY
    tags: RequestTags = RequestTags()
    stage: str | None = None
    after: str | None = None
    think_time: float = 0.0


@dataclass
class Topology:
    """How many replicas and how requests reach them.

    ``prefill`` and ``decode`` > 0 make the deployment disaggregated (``replicas`` is then
    ignored) with KV moving over ``link``.
    """

    replicas: int = 1
    router: str = "round-robin"
    prefill: int = 0
    decode: int = 0
    link: Link | None = None
    decode_router: str = "least-loaded"

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0 or self.decode > 0

    def validate(self) -> None:
        if self.disaggregated:
            if self.prefill < 1 or self.decode < 1:
                raise ValueError(
                    f"a disaggregated deployment needs at least one prefill and one decode "
                    f"replica, got {self.prefill}P:{self.decode}D"
                )
            if self.link is None:
                raise ValueError(
                    "a disaggregated deployment needs a KV link (--link nvlink|ib|...)"
                )
        elif self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")

    def describe(self) -> str:
        if self.disaggregated:
            return f"{self.prefill}P:{self.decode}D over {self.link.name if self.link else '?'}"
        return f"{self.replicas} replica(s), {self.router}"


# Builds one replica: (engine, executor) on the given clock. ``seed`` varies per replica.
EngineFactory = Callable[[VirtualClock, int], tuple[Any, SimExecutor]]


@dataclass(kw_only=True)
class Replica:
    index: int
    role: str  # vocab.ROLES
    engine: Any
    executor: SimExecutor
    clock: VirtualClock
    outstanding: int = 0
    last_step: float = 0.0  # the duration of its latest step (the serving path's pace)


@dataclass
class SimResult:
    records: list[ClientRecord]
    timelines: list[RequestTimeline]
    steps: list[dict[str, Any]]
    replicas: list[dict[str, Any]]
    topology: Topology
    num_steps: int = 0
    num_burst_steps: int = 0  # of those, how many ran in decode bursts
    sim_duration: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class _Client:
    req: SimRequest
    record: ClientRecord
    replica: Replica | None = None
    prefill_timeline: RequestTimeline | None = None


_SEND, _ARRIVE, _TRANSFER, _DONE = range(4)


def step_dict(rec: StepRecord) -> dict[str, Any]:
    """``rec``'s fields as a dict in field order, shallow (``prefill``, ``decode`` and
    ``preempted`` are the record's own): what ``{k: getattr(rec, k) for k in fields}``
    gives. A copy of the instance dict, which ``__init__`` filled in field order: a tenth
    of the comprehension's time, and asdict's deep copy costs more than the rest of a
    step here."""
    return rec.__dict__.copy()


class Simulation:
    """One simulated run. Build it, then call :meth:`run` once."""

    def __init__(
        self,
        factory: EngineFactory,
        requests: list[SimRequest],
        topology: Topology | None = None,
        network_delay: float = 0.0,
        max_concurrency: int | None = None,
        kv_bytes_per_token: float = 0.0,
        step_sink: Callable[[dict[str, Any]], None] | None = None,
        keep_steps: bool = True,
        block_size: int = 16,
        sim_seed: int = 0,
        decode_bursts: bool = True,
    ) -> None:
        self.topology = topology or Topology()
        self.topology.validate()
        if network_delay < 0:
            raise ValueError("network_delay must be >= 0 seconds")
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        self.requests = requests
        self.delay = network_delay
        self.limit = max_concurrency
        self.kv_bytes_per_token = kv_bytes_per_token
        self.step_sink = step_sink
        self.keep_steps = keep_steps
        self.steps: list[dict[str, Any]] = []
        self.num_steps = 0
        # Off: every step through ``engine.step``, the reference the bursts are tested against.
        self.decode_bursts = decode_bursts
        self.num_burst_steps = 0
        # Which requests of a burst the server hands over first is a race: each seed draws it.
        self._hand_over = random.Random(f"hand-over:{sim_seed}")
        topo = self.topology
        # Replica i draws from seed sim_seed * 100_000 + i (step noise, speculative acceptance).
        seeds = itertools.count(sim_seed * 100_000)

        def make(role: str, n: int) -> list[Replica]:
            out = []
            for i in range(n):
                clock = VirtualClock(T0)
                engine, ex = factory(clock, next(seeds))
                engine.replica, engine.role = i, role
                out.append(Replica(index=i, role=role, engine=engine, executor=ex, clock=clock))
            return out

        if topo.disaggregated:
            self.front = make(PREFILL_ROLE, topo.prefill)
            self.back = make(DECODE_ROLE, topo.decode)
            self.back_router: Router | None = make_router(
                topo.decode_router, topo.decode, block_size
            )
        else:
            self.front = make(COLOCATED, topo.replicas)
            self.back = []
            self.back_router = None
        self.front_router = make_router(topo.router, len(self.front), block_size)
        self.replicas = self.front + self.back
        # Every replica of a deployment is one target's, so one server path for all.
        self.path = self.front[0].executor.serving_path
        self.slots = sum(r.engine.config.max_num_seqs for r in self.front)
        self.lag = self.path.output_steps if self.path is not None else 0.0
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._clients: dict[str, _Client] = {}
        self._children: dict[str, list[SimRequest]] = {}
        self._ready: list[tuple[float, int, SimRequest]] = []  # (intended, seq, req)
        self._in_flight = 0
        self._timelines: list[RequestTimeline] = []

    # ---- events ----

    def _push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def _make_ready(self, req: SimRequest, intended: float) -> None:
        heapq.heappush(self._ready, (intended, next(self._seq), req))

    def _pump(self, now: float) -> None:
        """Send every ready request the concurrency limit allows (at its time, or now)."""
        while self._ready and (self.limit is None or self._in_flight < self.limit):
            intended, _, req = heapq.heappop(self._ready)
            self._in_flight += 1
            self._push(max(intended, now), _SEND, (req, intended))

    def _send(self, t: float, req: SimRequest, intended: float) -> None:
        self._clients[req.request_id] = _Client(req=req, record=_client_record(req, intended, t))
        if self.path is None:
            self._push(t + self.delay, _ARRIVE, req.request_id)
        else:
            inbound = self.path.inbound(len(req.prompt_token_ids))
            self._push(t + self.delay + inbound, _ARRIVE, req.request_id)

    def _add(
        self, replica: Replica, c: _Client, t: float, prompt: list[int], max_tokens: int
    ) -> bool:
        replica.clock.advance_to(t)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        try:
            replica.engine.add_request(
                c.req.request_id,
                prompt_token_ids=prompt,
                sampling_params=params,
                priority=c.req.tags.priority,
                arrival_time=t,
            )
        except ValueError as e:
            c.record.status = 400
            c.record.error = str(e)
            c.record.first_byte = t + self.delay
            self._push(t + self.delay, _DONE, c.req.request_id)
            return False
        replica.outstanding += 1
        c.replica = replica
        return True

    def _arrive(self, t: float, rid: str) -> None:
        c = self._clients[rid]
        c.record.first_byte = t + self.delay  # response headers go out on arrival
        pool, router = self.front, self.front_router
        idx = router.route(c.req.prompt_token_ids, [r.outstanding for r in pool])
        max_tokens = 1 if self.back else c.req.max_tokens
        self._add(pool[idx], c, t, c.req.prompt_token_ids, max_tokens)

    def _arrive_burst(self, t: float, rid: str) -> None:
        """``rid``'s arrival at ``t``; where the deployment is idle and its serving path hands
        a burst over in part, with every other arrival at ``t``, in an order the seed draws:
        the first of them arrive, the rest an instant later (after the first step started)."""
        path, events = self.path, self._events
        if (
            path is None
            or not path.first_steps
            or any(r.engine.has_unfinished() for r in self.replicas)
        ):
            self._arrive(t, rid)
            return
        burst = [rid]
        while events and events[0][0] == t and events[0][2] == _ARRIVE:
            burst.append(heapq.heappop(events)[3])
        self._hand_over.shuffle(burst)
        prompt = statistics.fmean(len(self._clients[r].req.prompt_token_ids) for r in burst)
        keep = path.first_step(len(burst), prompt, self.slots)
        for r in burst[:keep]:
            self._arrive(t, r)
        later = math.nextafter(t, math.inf)
        for r in burst[keep:]:
            self._push(later, _ARRIVE, r)

    def _transfer_done(self, t: float, rid: str) -> None:
        c = self._clients[rid]
        assert self.back_router is not None
        prompt = c.req.prompt_token_ids + [0]  # the first token came from the prefill replica
        idx = self.back_router.route(prompt, [r.outstanding for r in self.back])
        replica = self.back[idx]
        replica.executor.imported.add(rid)
        if not self._add(replica, c, t, prompt, c.req.max_tokens - 1):
            replica.executor.forget(rid)

    def _finish_client(self, t: float, rid: str) -> None:
        c = self._clients[rid]
        rec = c.record
        if rec.done is None:
            rec.done = t
        if not c.req.tags.stream and rec.chunk_times:
            rec.chunk_times = [t]
            rec.chunk_tokens = [sum(rec.chunk_tokens)]
        children = self._children.pop(rid, [])
        if not rec.ok:  # as the benchmark does, the rest of the session is not sent
            self._skip(children, rid, t)
            children = []
        # The next turn of a session keeps this request's concurrency slot.
        for child in children:
            self._push(t + child.think_time, _SEND, (child, t + child.think_time))
        if not children:
            self._in_flight -= 1
            self._pump(t)

    def _skip(self, reqs: list[SimRequest], failed: str, t: float) -> None:
        for req in reqs:
            error = f"skipped: turn {failed} of this session failed, so it was not sent"
            rec = _client_record(req, t, t, error)
            self._clients[req.request_id] = _Client(req=req, record=rec)
            self._skip(self._children.pop(req.request_id, []), failed, t)

    # ---- steps ----

    def _step(self, replica: Replica) -> None:
        before = replica.clock.now
        result = replica.engine.step()
        end = replica.clock.now
        self.num_steps += 1
        if result.record is not None:
            self._keep(result.record)
        if not result.outputs and end == before:
            raise RuntimeError(
                f"replica {replica.index} made no progress at t={end:.6f} with "
                f"{replica.engine.num_waiting} waiting and {replica.engine.num_running} running; "
                "the KV pool may be too small for a request (raise num_kv_blocks)"
            )
        client_t = end + self.delay
        if self.lag:
            client_t += self.lag * (replica.last_step or end - before)
            replica.last_step = end - before
        clients = self._clients
        for out in result.outputs:
            c = clients[out.request_id]
            rec_c = c.record
            t_c = client_t
            if self.lag and rec_c.chunk_times:
                t_c = max(t_c, rec_c.chunk_times[-1])
            if out.new_token_ids:
                rec_c.chunk_times.append(t_c)
                rec_c.chunk_tokens.append(len(out.new_token_ids))
            if out.finished:
                self._finished(replica, out, c, end, t_c)

    def _finished(
        self, replica: Replica, out: RequestOutput, c: _Client, end: float, client_t: float
    ) -> None:
        """A request finished on ``replica`` at ``end``: hand it on (prefill) or answer it."""
        rec_c = c.record
        replica.outstanding -= 1
        replica.executor.forget(out.request_id)
        tl = out.timeline
        if replica.role == PREFILL_ROLE and out.finish_reason is not FinishReason.ERROR:
            rec_c.output_tokens = 1
            if c.req.max_tokens > 1:
                c.prefill_timeline = tl
                nbytes = len(c.req.prompt_token_ids) * self.kv_bytes_per_token
                assert self.topology.link is not None
                self._push(
                    end + self.topology.link.transfer_time(nbytes), _TRANSFER, out.request_id
                )
                return
        else:
            rec_c.output_tokens = (1 if c.prefill_timeline else 0) + out.num_output_tokens
        if c.prefill_timeline is not None:
            tl = _merge(c.prefill_timeline, tl)
        if out.finish_reason is FinishReason.ERROR:
            rec_c.error = tl.error or "engine error"
            rec_c.status = 500
        else:
            rec_c.status = 200
        rec_c.server_timeline = tl.summary()
        self._timelines.append(tl)
        self._push(client_t, _DONE, out.request_id)

    def _keep(self, rec: StepRecord) -> None:
        if self.keep_steps or self.step_sink is not None:
            d = step_dict(rec)
            if self.step_sink is not None:
                self.step_sink(d)
            if self.keep_steps:
                self.steps.append(d)

    def _keep_all(self, recs: list[StepRecord]) -> None:
        """``_keep`` of each (a burst's records), without two calls per step."""
        steps = [step_dict(rec) for rec in recs]
        if self.step_sink is not None:
            for d in steps:
                self.step_sink(d)
        if self.keep_steps:
            self.steps += steps

    def _burst(self, replica: Replica, horizon: float) -> bool:
        """Run ``replica``'s steps before ``horizon`` in one decode burst, if its next step is
        one; False if not. Nothing else can happen meanwhile: no event falls before the
        horizon, and only the burst's last step can finish requests (push events)."""
        want = self.keep_steps or self.step_sink is not None
        start = replica.clock.now
        burst = replica.engine.decode_burst(horizon, keep_records=want)
        if burst is None:
            return False
        ends = burst.ends
        self.num_steps += len(ends)
        self.num_burst_steps += len(ends)
        if want:
            self._keep_all(burst.records)
        if self.lag:
            lag, delay, last, prev = self.lag, self.delay, replica.last_step, start
            client_times = []
            for e in ends:
                dt = e - prev
                client_times.append(e + delay + lag * (last or dt))
                last, prev = dt, e
            replica.last_step = last
        else:
            client_times = [end + self.delay for end in ends]
        ones = [1] * len(ends)
        clients = self._clients
        for req in burst.requests:
            rec_c = clients[req.request_id].record
            if self.lag and rec_c.chunk_times and rec_c.chunk_times[-1] > client_times[0]:
                # A decode step shorter than the step before: the stream keeps its order.
                last = rec_c.chunk_times[-1]
                rec_c.chunk_times += [max(t, last) for t in client_times]
            else:
                rec_c.chunk_times += client_times
            rec_c.chunk_tokens += ones
        for out in burst.finished:
            c = clients[out.request_id]
            self._finished(replica, out, c, ends[-1], c.record.chunk_times[-1])
        return True

    # ---- main loop ----

    def run(self) -> SimResult:
        for req in sorted(self.requests, key=lambda r: r.send_time):
            if req.after is not None:
                self._children.setdefault(req.after, []).append(req)
            else:
                self._make_ready(req, T0 + req.send_time)
        known = {r.request_id for r in self.requests}
        orphans = [p for p in self._children if p not in known]
        if orphans:
            raise ValueError(f"requests wait for unknown request ids: {orphans[:3]}")
        self._pump(T0)
        with cyclic_gc_paused():
            self._loop()
        records = [
            self._clients[r.request_id].record
            for r in self.requests
            if r.request_id in self._clients
        ]
        ends = [r.clock.now for r in self.replicas]
        return SimResult(
            records=records,
            timelines=self._timelines,
            steps=self.steps,
            replicas=[self._replica_summary(r) for r in self.replicas],
            topology=self.topology,
            num_steps=self.num_steps,
            num_burst_steps=self.num_burst_steps,
            sim_duration=max([*ends, *(r.done or T0 for r in records)]) - T0,
        )

    def _loop(self) -> None:
        """Advance the earliest of the next event and the furthest-behind busy replica."""
        replicas = self.replicas
        events = self._events
        while True:
            busy = None
            for r in replicas:
                if r.engine.has_unfinished() and (busy is None or r.clock.now < busy.clock.now):
                    busy = r
            t_ev = events[0][0] if events else math.inf
            t_busy = busy.clock.now if busy is not None else math.inf
            if t_ev == math.inf and t_busy == math.inf:
                break
            if t_ev <= t_busy:
                t, _, kind, payload = heapq.heappop(events)
                if kind == _SEND:
                    self._send(t, *payload)
                elif kind == _ARRIVE:
                    self._arrive_burst(t, payload)
                elif kind == _TRANSFER:
                    self._transfer_done(t, payload)
                else:
                    self._finish_client(t, payload)
            else:
                assert busy is not None
                if not (self.decode_bursts and self._burst(busy, self._horizon(busy, t_ev))):
                    self._step(busy)

    def _horizon(self, busy: Replica, t_ev: float) -> float:
        """The time before which ``busy`` keeps being the one the loop advances (see _loop):
        the next event, and each other busy replica's clock, which a replica earlier in the
        list wins on a tie."""
        if len(self.replicas) == 1:
            return t_ev
        horizon = t_ev
        before = True
        for r in self.replicas:
            if r is busy:
                before = False
            elif r.engine.has_unfinished():
                now = r.clock.now
                horizon = min(horizon, now if before else math.nextafter(now, math.inf))
        return horizon

    def _replica_summary(self, r: Replica) -> dict[str, Any]:
        from dataclasses import asdict

        return {
            "index": r.index,
            "role": r.role,
            "steps": r.executor.steps,
            "busy_time": r.executor.busy_time,
            "stats": asdict(r.engine.stats()),
        }


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (process-wide) for the event loop, or for
    writing its run directory (``sim.run_writer``).

    The loop allocates millions of short-lived objects (plans, outputs, step records)
    beside a heap that grows with every request; the collector kept walking that heap
    (about 6% of a whole-trace replay) and found no cycles: reference counting frees
    everything the loop makes. Any cycle made meanwhile is collected once it resumes.
    Writing the run builds every timeline's dict and the summary's arrays beside that
    heap, enough to start a full collection: 2.4 s walking a whole-trace run's objects.

    Everything the run kept is then in the youngest generation, which the first allocation
    after resuming would walk whole (0.2 s after a whole-trace replay) to find nothing. It
    moves to the oldest generation instead (``freeze`` then ``unfreeze`` splice the
    generation lists, O(1)), where the next full collection sees it; skipped when the
    caller has frozen objects of its own, which ``unfreeze`` would release.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def _merge(prefill: RequestTimeline, decode: RequestTimeline) -> RequestTimeline:
    """One timeline for a disaggregated request: prefill side, then the decode side's tokens."""
    return replace(
        prefill,
        token_times=prefill.token_times + decode.token_times,
        preemptions=prefill.preemptions + decode.preemptions,
        spec=prefill.spec + decode.spec,
        finished=decode.finished,
        finish_reason=decode.finish_reason,
        output_tokens=prefill.output_tokens + decode.output_tokens,
        error=decode.error,
        decode_replica=decode.replica,
    )


def _client_record(
    req: SimRequest, intended: float, actual: float, error: str | None = None
) -> ClientRecord:
    """The client's record of a planned request sent (or skipped) at ``actual``."""
    return ClientRecord.for_request(
        req.request_id,
        req.tags,
        stage=req.stage,
        intended_send=intended,
        actual_send=actual,
        input_tokens=len(req.prompt_token_ids),
        requested_output_tokens=req.max_tokens,
        error=error,
    )
