"""The router of disaggregated serving: the API process's handle on P prefill + D decode workers.

``DisaggClient`` is a ``server.serving_client.ServingClient``, as ``EngineClient`` is (submit,
abort, streams, metrics, timelines, utility calls, liveness), so the HTTP layer is unchanged.

Contract:
- **Routing.** On arrival a request is given a decode worker: the live one with the most free
  KV blocks (its last report minus reservations asked for since) that has room for the
  prompt's blocks, which it reserves while the request is prefilled; and a prefill worker:
  the live one with the fewest requests routed to it and not yet handed off (queue length).
  The first token is streamed as soon as the prefill worker sends it, and the blocks follow
  to the decode worker at once. ``max_tokens=1`` requests need no decode worker.
- **Backpressure.** When no decode worker has room, requests wait at the router in FIFO order
  (a request already on a prefill worker whose reservation was refused keeps its place at
  the front, its blocks held there): prefill waits, nothing is dropped. A decode worker that
  refused is not asked again before it reports progress.
- **Timeouts.** Every wait has one and each is reported to the client and in
  ``servelab:kv_transfer_failures{reason}``: waiting for decode room longer than
  ``handoff_timeout`` (from arrival, or from the first token for a parked request); the
  transfer not done ``transfer_timeout`` after the first token (or after the reservation, if
  later). The request fails and its blocks are freed on both sides (aborted everywhere).
- **Faults.** When a worker dies, every request it holds ends with an ``engine_dead`` error
  naming it, the other workers keep serving, and ``/health`` lists it as dead (503 only
  once no prefill or no decode worker is left).
- **Accounting.** Each request ends exactly once: with the engine's final output (its
  timeline continued from the prefill side to the decode side, plus ``kv_transfer``), or
  with the router's own error when a hand-off fails. Late outputs of a closed request (an
  abort crossing a hand-off) are ignored.
- Step records of all workers get one increasing ``step_id`` (the worker's own is kept as
  ``worker_step_id``) and ``replica``/``role``, as in the simulator.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from servelab.engine.routing import pick_decode, pick_prefill
from servelab.server import ipc
from servelab.server.core_process import CoreStartupError, EngineDeadError
from servelab.server.disagg import shm, wire
from servelab.server.disagg.disagg_metrics import DisaggMetrics
from servelab.server.disagg.requests import Reserve, RouterRequest, RouterStage
from servelab.server.disagg.wire import KVEvents, WorkerReady
from servelab.server.disagg.worker_pool import Worker, make_workers
from servelab.server.engine_client import CALL_TIMEOUT_S, EXIT_TIMEOUT_S, RequestStream
from servelab.server.metrics import ServerMetrics
from servelab.server.server_args import ServerArgs
from servelab.server.timelines import TimelineStore
from servelab.vocab import FinishReason, RequestTimeline

log = logging.getLogger("servelab.server.disagg")

_TICK_S = 0.1  # deadline checks
_SUMMED_STATS = (
    "kv_blocks_used",
    "kv_blocks_total",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "evictions",
    "num_preemptions",
    "num_waiting",
    "num_running",
)
_GAUGES = ("kv_blocks_used", "kv_blocks_total", "num_waiting", "num_running")


# How many finished requests' transfer records wait for a late ``sent`` report.
_LATE_SENT_KEPT = 1024


def _transfer_times(t: dict[str, Any]) -> None:
    """A transfer record's ``seconds`` (sender's start, or the receiver's pick-up while the
    sender's report is missing, -> written) and ``handoff_wait`` (parked -> that start)."""
    start = t.get("start", t["received"])
    t["seconds"] = t["end"] - start
    t["handoff_wait"] = start - t.get("parked", t["received"])


class DisaggClient:
    """Starts, feeds and watches the workers (see the module docstring)."""

    def __init__(
        self,
        args: ServerArgs,
        metrics: ServerMetrics,
        timelines: TimelineStore,
        engine_factory: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.args = args
        self.metrics = metrics
        self.dmetrics = DisaggMetrics(metrics.registry, args.model_name)
        self.timelines = timelines
        self.clock = clock
        self.info: ipc.CoreInfo | None = None
        self.handoff_timeout = args.kv_handoff_timeout
        self.transfer_timeout = args.kv_transfer_timeout
        self._session = uuid.uuid4().hex[:12]
        self._kv_dir = tempfile.mkdtemp(prefix="servelab-kv-")
        self._reqs: dict[str, RouterRequest] = {}
        self._streams: dict[str, RequestStream] = {}
        self._awaiting: collections.deque[str] = collections.deque()  # need decode room
        # Transfer records of finished requests whose sender's report (``sent``) is still on
        # its way: patched in place (the timeline store holds the same dict) when it comes.
        self._late_sent: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._steps = itertools.count()
        self._call_ids = itertools.count()
        self._tasks: list[asyncio.Task[Any]] = []
        self._closing = False
        self.workers, self.cpu_plan = make_workers(
            args, self._kv_dir, self._session, engine_factory
        )

    # ---- workers ----

    def _live(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role and w.alive]

    @property
    def pid(self) -> int:
        return os.getpid()

    @property
    def alive(self) -> bool:
        return not self._closing and bool(self._live("prefill")) and bool(self._live("decode"))

    @property
    def dead_reason(self) -> str | None:
        if self.alive:
            return None
        dead = [w.dead_reason for w in self.workers if w.dead_reason]
        missing = [r for r in ("prefill", "decode") if not self._live(r)]
        return f"no {' or '.join(missing)} worker is running" + (
            f" ({'; '.join(dead)})" if dead else ""
        )

    def health_report(self) -> tuple[bool, dict[str, Any]]:
        """(serving, body): serving while a prefill and a decode worker are alive."""
        ok = self.alive
        degraded = any(not w.alive for w in self.workers)
        status = "ok" if ok and not degraded else ("degraded" if ok else "down")
        return ok, {"status": status, "workers": [w.describe() for w in self.workers]}

    def workers_info(self) -> list[dict[str, Any]]:
        return [w.describe() for w in self.workers]

    async def start(self) -> ipc.CoreInfo:
        """Start every worker at once; raise CoreStartupError naming the one that failed."""
        log.info("servelab serve --disaggregated: %s", self.cpu_plan)

        async def start_one(w: Worker) -> None:
            try:
                msg = await w.proc.start(msgspec.json.encode(w.config))
            except CoreStartupError as e:
                raise CoreStartupError(f"{w.name} worker: {e}") from None
            if not isinstance(msg, WorkerReady):
                raise CoreStartupError(f"{w.name} worker sent {type(msg).__name__} before Ready")
            w.ready, w.alive = msg, True
            w.update(msg.stats)

        results = await asyncio.gather(
            *(start_one(w) for w in self.workers), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        infos = [w.ready.info for w in self.workers if w.ready]
        first = infos[0]
        self.info = msgspec.structs.replace(
            first,
            max_model_len=min(i.max_model_len for i in infos),
            num_kv_blocks=min(i.num_kv_blocks for i in infos),
            pid=os.getpid(),
        )
        self.metrics.set_baseline(self._summed_stats())
        for w in self.workers:
            self._tasks.append(asyncio.create_task(self._receive_loop(w), name=f"sl-{w.name}"))
            self._tasks.append(asyncio.create_task(self._watch(w), name=f"sl-{w.name}-watch"))
        self._tasks.append(asyncio.create_task(self._tick(), name="servelab-disagg-tick"))
        self._publish()
        return self.info

    async def shutdown(self) -> None:
        self._closing = True
        await asyncio.gather(*(w.proc.stop(EXIT_TIMEOUT_S) for w in self.workers))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for rid in list(self._reqs):
            self._close_with_error(rid, "the server is shutting down", dead=True)
        for w in self.workers:
            w.alive = False
            self._fail_calls(w, "the server is shutting down")
            w.proc.close()
        shm.remove_session(self._session)
        with contextlib.suppress(OSError):
            for p in os.scandir(self._kv_dir):
                os.unlink(p.path)
            os.rmdir(self._kv_dir)

    async def _watch(self, w: Worker) -> None:
        code = await w.proc.wait_exit()
        if self._closing:
            return
        w.alive = False
        w.dead_reason = f"{w.name} worker (pid {w.pid}) exited unexpectedly (exit code {code})"
        log.error("servelab serve: %s; the other workers keep serving", w.dead_reason)
        shm.remove_session(self._session, w.index)
        self._fail_calls(w, w.dead_reason)
        for r in list(self._reqs.values()):
            if w.index in (r.prefill, r.decode) and self._depends_on(r, w):
                self._worker_lost(r, w)
        if not self.alive:  # no prefill or no decode worker left: the server cannot serve
            self.metrics.engine_down()
        self._dispatch()
        self._publish()

    @staticmethod
    def _depends_on(r: RouterRequest, w: Worker) -> bool:
        if r.prefill == w.index and not r.sent:
            return r.stage in (RouterStage.PREFILL, RouterStage.HANDOFF, RouterStage.TRANSFER)
        return r.decode == w.index and r.stage is not RouterStage.HELD

    def _worker_lost(self, r: RouterRequest, w: Worker) -> None:
        """``w`` is gone while holding part of ``r``: end ``r``, free its other side."""
        if r.stage is RouterStage.TRANSFER:
            self.dmetrics.transfer_failed("worker_died")
        self._abort_everywhere(r)
        reason = w.dead_reason or f"the {w.name} worker is not accepting requests"
        self._close_with_error(r.rid, f"{reason}; the request could not finish", dead=True)

    def _send(self, w: Worker, msg: Any) -> bool:
        if not w.alive:
            return False
        try:
            w.proc.send(msg)
        except EngineDeadError:
            return False
        return True

    def _fail_calls(self, w: Worker, reason: str) -> None:
        for fut in w.calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        w.calls.clear()

    # ---- requests (the ServingClient surface) ----

    @property
    def num_waiting(self) -> int:
        """Held at the router, queued on prefill workers, and adds still in transit."""
        prefill = self._live("prefill")
        return self._num_held() + sum(
            w.stats.get("num_waiting", 0) + w.adds_sent - w.adds_seen for w in prefill
        )

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._streams or request_id in self._reqs

    def submit(self, req: ipc.AddRequest) -> RequestStream:
        if not self.alive:
            raise EngineDeadError(self.dead_reason or "the workers are not running")
        stream = RequestStream(req.request_id)
        assert self.info is not None
        r = RouterRequest(
            req, stream, need_blocks=-(-len(req.prompt_token_ids) // self.info.block_size)
        )
        self._reqs[req.request_id] = r
        self._streams[req.request_id] = stream
        if req.sampling.get("max_tokens", 2) <= 1:  # it ends at its first token
            self._to_prefill(r)
        else:
            r.deadline = self.clock() + self.handoff_timeout
            self._awaiting.append(req.request_id)
            self._dispatch()
        self._publish()
        return stream

    def abort(self, request_id: str) -> None:
        """The client went away: end the request wherever it is and free its blocks."""
        stream = self._streams.pop(request_id, None)
        r = self._reqs.get(request_id)
        if r is None or (stream is not None and stream.finished):
            return
        r.stream = None
        with contextlib.suppress(ValueError):
            self._awaiting.remove(request_id)
        if r.stage is RouterStage.HELD:
            self._close(r, self._router_timeline(r, FinishReason.ABORT))
            return
        r.aborting = True
        self._abort_everywhere(r)

    def abort_all(self) -> int:
        streams = list(self._streams.items())
        for rid, stream in streams:
            self.abort(rid)
            stream.push(ipc.Output(rid, [], "", True, "abort", 0, 0))
        return len(streams)

    async def call(self, method: str) -> Any:
        """Run an engine utility method on every live worker; True only if all agree."""
        live = [w for w in self.workers if w.alive]
        if not live or not self.alive:
            raise EngineDeadError(self.dead_reason or "the workers are not running")
        loop = asyncio.get_running_loop()
        futs = []
        for w in live:
            call_id = next(self._call_ids)
            fut: asyncio.Future[Any] = loop.create_future()
            w.calls[call_id] = fut
            futs.append((w, call_id, fut))
            self._send(w, ipc.UtilityCall(call_id, method))
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*(f for _, _, f in futs)), CALL_TIMEOUT_S
            )
        finally:
            for w, call_id, _ in futs:
                w.calls.pop(call_id, None)
        return all(results)

    # ---- routing ----

    def _to_prefill(self, r: RouterRequest) -> None:
        live = self._live("prefill")
        if not live:
            self._close_with_error(r.rid, self.dead_reason or "no prefill worker", dead=True)
            return
        pick = pick_prefill([x.outstanding for x in live])
        assert pick is not None  # live is not empty
        w = live[pick]
        r.stage, r.prefill, r.deadline = RouterStage.PREFILL, w.index, float("inf")
        w.outstanding += 1
        w.adds_sent += 1
        if not self._send(w, r.add):
            self._worker_lost(r, w)

    def _pick_decode(self, need: int) -> Worker | None:
        askable = [w for w in self._live("decode") if not w.refused]
        pick = pick_decode([w.free_blocks - sum(w.asked.values()) for w in askable], need)
        return None if pick is None else askable[pick]

    def _dispatch(self) -> None:
        """Give decode reservations in FIFO order while decode workers have room; a request
        not yet on a prefill worker goes there at the same time."""
        if not self._live("decode"):  # nothing can decode: end what waits for it
            for rid in list(self._awaiting):
                self._abort_everywhere(self._reqs[rid])
                self._close_with_error(rid, self.dead_reason or "no decode worker", dead=True)
        while self._awaiting:
            r = self._reqs[self._awaiting[0]]
            w = self._pick_decode(r.need_blocks)
            if w is None:
                break
            self._awaiting.popleft()
            r.reserve, r.decode = Reserve.ASKED, w.index
            w.asked[r.rid] = r.need_blocks
            if r.stage is RouterStage.HANDOFF:
                r.stage, r.deadline = RouterStage.TRANSFER, self.clock() + self.transfer_timeout
            msg = wire.ImportKV(
                r.rid,
                r.add.prompt_token_ids,
                r.add.sampling,
                r.add.priority,
                r.add.arrival_time,
                r.prefill or 0,
            )
            if not self._send(w, msg):
                self._worker_lost(r, w)
            elif r.stage is RouterStage.HELD:
                self._to_prefill(r)
        self._publish()

    def _num_held(self) -> int:
        return sum(1 for rid in self._awaiting if self._reqs[rid].stage is RouterStage.HELD)

    # ---- worker messages ----

    async def _receive_loop(self, w: Worker) -> None:
        while True:
            msg = await w.proc.recv()
            if isinstance(msg, ipc.StepBatch):
                self._on_batch(w, msg)
            elif isinstance(msg, KVEvents):
                self._on_events(w, msg)
            elif isinstance(msg, ipc.UtilityResult):
                fut = w.calls.get(msg.call_id)
                if fut is not None and not fut.done():
                    if msg.error is None:
                        fut.set_result(msg.result)
                    else:
                        fut.set_exception(RuntimeError(f"{w.name}: {msg.error}"))

    def _on_batch(self, w: Worker, batch: ipc.StepBatch) -> None:
        m = self.metrics
        m.core_to_api.observe(max(0.0, self.clock() - batch.sent_at))
        for delay in batch.add_delays:
            m.api_to_core.observe(max(0.0, delay))
        w.adds_seen, w.busy, w.idle = batch.added_total, batch.busy, batch.idle
        w.update(batch.stats)
        w.refused = False  # it made progress: worth asking again
        if batch.record is not None:
            record = dict(batch.record)
            record["worker_step_id"] = record["step_id"]
            record.update(step_id=next(self._steps))
            m.observe_step(record)
            self.timelines.add_step(record)
        for out in batch.outputs:
            self._on_output(w, out)
        self._dispatch()

    def _on_output(self, w: Worker, out: ipc.Output) -> None:
        r = self._reqs.get(out.request_id)
        if r is None:
            return  # closed already (e.g. an abort that crossed a hand-off)
        if w.role == "decode" and r.parked is None and not r.aborting:
            r.deferred.append((w, out))  # the prefill side's first token is not in yet
            return
        n_new = len(out.new_token_ids)
        first = n_new > 0 and out.num_output_tokens == n_new
        self.metrics.observe_tokens(out.num_prompt_tokens if first else 0, n_new)
        r.num_output_tokens = out.num_output_tokens or r.num_output_tokens
        if not out.finished:
            if r.stream is not None:
                r.stream.push(out)
            return
        if r.stage is RouterStage.PREFILL and r.prefill is not None:
            self.workers[r.prefill].outstanding -= 1
        if w.role == "prefill" and r.decode is not None:  # ended at its first token
            self._send(self.workers[r.decode], ipc.Abort([r.rid]))  # free the reservation
        if out.timeline is None:  # rejected by the engine before it had a timeline
            self.metrics.observe_rejected_by_engine()
            self._drop(r)
            if r.stream is not None:
                r.stream.push(out)
            return
        owner = r.decode if r.stage is RouterStage.DECODE else r.prefill
        if r.aborting and w.index != owner:
            # The other side's copy (e.g. a reservation's) lacks what the client already got.
            out.timeline = self._router_timeline(r, FinishReason.ABORT)
        elif r.transfer:
            out.timeline["kv_transfer"] = dict(r.transfer)
            if not r.sent and "end" in r.transfer:
                self._late_sent[r.rid] = out.timeline["kv_transfer"]
                while len(self._late_sent) > _LATE_SENT_KEPT:
                    self._late_sent.popitem(last=False)
        self._close(r, out.timeline, out)

    def _on_events(self, w: Worker, ev: KVEvents) -> None:
        w.update(ev.stats)
        now = self.clock()
        for p in ev.parked:
            r = self._live_req(p.request_id)
            if r is None:
                continue
            w.outstanding -= 1
            r.parked = p
            r.transfer.update(prefill_worker=w.index, transport=self.args.kv_transport)
            r.transfer["parked"] = p.parked_at
            if r.reserve is Reserve.NONE:
                r.stage, r.deadline = RouterStage.HANDOFF, now + self.handoff_timeout
            else:
                r.stage, r.deadline = RouterStage.TRANSFER, now + self.transfer_timeout
        for res in ev.reserved:
            w.asked.pop(res.request_id, None)
            r = self._live_req(res.request_id)
            if r is None:
                continue
            r.reserve = Reserve.RESERVED
            if r.stage is RouterStage.TRANSFER:
                r.deadline = max(r.deadline, now + self.transfer_timeout)
            r.transfer.update(decode_worker=w.index, skipped_blocks=res.skip_blocks)
            p = self.workers[r.prefill or 0]
            address = w.ready.kv_address if w.ready else None
            if not self._send(p, wire.SendKV(r.rid, address or "", res.skip_blocks, w.index)):
                self._worker_lost(r, p)
        for ref in ev.refused:
            w.asked.pop(ref.request_id, None)
            r = self._live_req(ref.request_id)
            if r is None:
                continue
            if ref.retry:  # keep its place at the front; its prefill goes on meanwhile
                w.refused = True
                r.reserve, r.decode = Reserve.NONE, None
                if r.stage is RouterStage.TRANSFER:
                    r.stage, r.deadline = RouterStage.HANDOFF, now + self.handoff_timeout
                self._awaiting.appendleft(r.rid)
            else:
                self.dmetrics.transfer_failed("refused")
                self._fail(r, f"the decode worker {w.name} refused the request: {ref.error}", 400)
        for s in ev.sent:
            r = self._live_req(s.request_id)
            if r is not None:
                r.sent = True
                r.transfer.update(start=s.start, sent=s.end, bytes=s.nbytes, blocks=s.num_blocks)
            elif (late := self._late_sent.pop(s.request_id, None)) is not None:
                late.update(start=s.start, sent=s.end)
                _transfer_times(late)
        for imp in ev.imported:
            r = self._live_req(imp.request_id)
            if r is None:
                continue
            if r.parked is None:
                r.deferred.append((w, imp))
            else:
                self._imported(r, imp)
        for f in ev.failed:
            r = self._live_req(f.request_id)
            if r is None:
                continue
            self.dmetrics.transfer_failed(f.reason)
            self._fail(r, f"KV transfer failed ({f.reason}) on {w.name}: {f.error}", 503)
        for p in ev.parked:
            r = self._reqs.get(p.request_id)
            if r is not None and r.deferred:
                self._replay(r)
        self._dispatch()

    def _imported(self, r: RouterRequest, imp: wire.Imported) -> None:
        r.stage, r.deadline = RouterStage.DECODE, float("inf")
        t = r.transfer
        t.update(received=imp.received, end=imp.end)
        # The sender's own report (``sent``) comes on the prefill worker's channel and can
        # arrive after a short decode has already finished; what the receiver counted is
        # the same, so the record is complete either way.
        t.setdefault("blocks", imp.num_blocks)
        t.setdefault("bytes", imp.nbytes)
        _transfer_times(t)
        self.dmetrics.transfer_ok(
            t["seconds"], imp.nbytes, imp.num_blocks, t.get("skipped_blocks", 0)
        )
        self.dmetrics.handoff_wait.observe(max(0.0, t["handoff_wait"]))

    def _replay(self, r: RouterRequest) -> None:
        """Handle what the decode worker sent before the prefill side's messages arrived.

        The two workers' channels are read by separate tasks, so the decode side's first
        tokens can overtake the prefill side's first token and hand-off events."""
        deferred, r.deferred = r.deferred, []
        for w, item in deferred:
            if self._reqs.get(r.rid) is not r:
                return
            if isinstance(item, ipc.Output):
                self._on_output(w, item)
            elif not r.aborting:
                self._imported(r, item)

    def _live_req(self, request_id: str) -> RouterRequest | None:
        r = self._reqs.get(request_id)
        return None if r is None or r.aborting else r

    # ---- deadlines ----

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(_TICK_S)
            now = self.clock()
            for r in [r for r in self._reqs.values() if r.deadline <= now and not r.aborting]:
                self._timed_out(r)

    def _timed_out(self, r: RouterRequest) -> None:
        self.dmetrics.transfer_failed("timeout")
        if r.stage in (RouterStage.HELD, RouterStage.HANDOFF):
            what = (
                f"no decode worker had room for its {r.need_blocks} KV blocks within "
                f"{self.handoff_timeout:g} s (--kv-handoff-timeout); add decode workers or "
                "KV memory, or lower the load"
            )
        else:
            what = (
                f"the KV transfer did not complete within {self.transfer_timeout:g} s "
                "(--kv-transfer-timeout)"
            )
        self._fail(r, f"request timed out in the {r.stage.value} stage: {what}", 503)

    # ---- ending requests ----

    def _abort_everywhere(self, r: RouterRequest) -> None:
        """Tell every worker that may hold the request's blocks to free them."""
        if r.prefill is not None and not r.sent:
            self._send(self.workers[r.prefill], ipc.Abort([r.rid]))
        if r.decode is not None:
            self._send(self.workers[r.decode], ipc.Abort([r.rid]))

    def _fail(self, r: RouterRequest, message: str, status: int) -> None:
        """End a request with the router's error; free its blocks on both sides."""
        self._abort_everywhere(r)
        self._close_with_error(r.rid, message, status=status)

    def _close_with_error(
        self, rid: str, message: str, status: int = 503, dead: bool = False
    ) -> None:
        r = self._reqs.get(rid)
        if r is None:
            return
        if r.stage is RouterStage.PREFILL and r.prefill is not None:
            self.workers[r.prefill].outstanding -= 1
        reason = FinishReason.ABORT if r.aborting else FinishReason.ERROR
        tl = self._router_timeline(r, reason, None if r.aborting else message)
        if r.stream is not None and dead:
            r.stream.fail(message)
            r.stream = None
        out = ipc.Output(
            rid,
            [],
            "",
            True,
            reason.value,
            len(r.add.prompt_token_ids),
            r.num_output_tokens,
            error=None if r.aborting else message,
            error_status=status,
        )
        self._close(r, tl, out)

    def _router_timeline(
        self, r: RouterRequest, reason: FinishReason, error: str | None = None
    ) -> dict[str, Any]:
        """The best timeline the router has for a request it ends itself."""
        if r.parked is not None:
            tl = RequestTimeline.from_dict(r.parked.timeline)
        else:
            arrival = r.add.arrival_time
            tl = RequestTimeline(
                r.rid,
                arrival,
                r.add.priority,
                len(r.add.prompt_token_ids),
                queued=[arrival],
            )
        tl.finished, tl.finish_reason, tl.error = self.clock(), reason, error
        tl.output_tokens = r.num_output_tokens
        d = tl.to_dict()
        if r.transfer:
            d["kv_transfer"] = dict(r.transfer)
        return d

    def _close(
        self, r: RouterRequest, timeline: dict[str, Any], out: ipc.Output | None = None
    ) -> None:
        """Record how the request ended (once) and give its stream the final output."""
        self._drop(r)
        self.timelines.add_timeline(timeline)
        self.metrics.observe_finished(RequestTimeline.from_dict(timeline))
        if out is not None:
            out.timeline = timeline
            if r.stream is not None:
                r.stream.push(out)
        self._streams.pop(r.rid, None)
        self._publish()

    def _drop(self, r: RouterRequest) -> None:
        self._reqs.pop(r.rid, None)
        self._streams.pop(r.rid, None)
        with contextlib.suppress(ValueError):
            self._awaiting.remove(r.rid)

    # ---- metrics ----

    def _summed_stats(self) -> dict[str, Any]:
        total: dict[str, Any] = dict.fromkeys(_SUMMED_STATS, 0)
        for w in self.workers:
            for k in _SUMMED_STATS:
                if w.alive or k not in _GAUGES:
                    total[k] += w.stats.get(k, 0)
        total["num_waiting"] += self._num_held()
        total["kv_usage"] = (
            total["kv_blocks_used"] / total["kv_blocks_total"] if total["kv_blocks_total"] else 0.0
        )
        return total

    def _publish(self) -> None:
        """Refresh the aggregate engine gauges/counters and the per-worker and stage gauges."""
        if self.info is None:
            return
        self.metrics.update_engine(
            self._summed_stats(),
            sum(w.busy for w in self.workers),
            sum(w.idle for w in self.workers),
        )
        for w in self.workers:
            self.dmetrics.worker(w.name, w.role, w.alive, w.stats)
        counts: dict[str, int] = collections.Counter(r.stage.value for r in self._reqs.values())
        self.dmetrics.stages(counts)
