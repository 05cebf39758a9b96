"""A disaggregated worker process: an engine core in the prefill or the decode role.

Started by the router as ``python -m servelab.server.disagg.worker_process`` with a ``WorkerConfig`` (JSON)
on stdin. It is the engine core's loop (``server/engine_core.py``, same channels, same StepBatch
outputs) over a ``DisaggEngine``, plus the hand-off messages of ``wire.py``:

- **prefill**: requests arrive as ``AddRequest``; after the step that samples a request's
  first token the StepBatch carrying that token goes out first, then ``KVEvents.parked``.
  ``SendKV`` says where the blocks go: they are sent the moment the request parks (or at
  once if it already has), and freed (``sent``, or ``failed``).
- **decode**: ``ImportKV`` reserves blocks (``reserved``/``refused``); payloads arriving on
  the transport are checked, written and decoded from the next step (``imported``). A
  reservation whose payload has not come within ``reservation_timeout`` ends with
  ``failed`` (a backstop: the router times transfers out itself and aborts).

Events produced while handling inputs and payloads are sent before the iteration's
StepBatch, so the router always learns that a request moved before it sees its tokens.
Threads: the worker pins itself to ``cpus`` (when given) before torch starts its pools.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import msgspec
import zmq

from servelab.server import engine_core, ipc
from servelab.server.disagg import wire
from servelab.server.disagg.wire import (
    Failed,
    ImportKV,
    KVEvents,
    Reserved,
    SendKV,
    WorkerConfig,
    WorkerReady,
)
from servelab.server.disagg.worker_engine import DisaggEngine, TransferError

log = logging.getLogger("servelab.server.disagg.worker_process")

_DEADLINE_POLL_MS = 100  # idle wake-up period while a transfer deadline is pending
_BACKLOG_POLL_MS = 2  # idle wake-up period while transfers wait for their socket


def build_engine(cfg: ipc.CoreConfig) -> DisaggEngine:
    """The default engine factory of a worker: the real model in a DisaggEngine."""
    return engine_core.build_engine(cfg, DisaggEngine)


class WorkerCore(engine_core.EngineCore):
    """The engine core's loop plus the hand-off (see the module docstring)."""

    decode_input = staticmethod(wire.decode_worker_input)

    def __init__(
        self,
        engine: DisaggEngine,
        inputs: zmq.Socket,
        outputs: zmq.Socket,
        parent_pid: int,
        wcfg: WorkerConfig,
    ) -> None:
        from servelab.server.disagg.transport import make_receiver, make_sender

        super().__init__(engine, inputs, outputs, parent_pid)
        self.wcfg = wcfg
        self._ctx = zmq.Context()
        self.receiver = None
        self.sender = None
        if wcfg.role == "decode":
            self.receiver = make_receiver(
                wcfg.transport, self._ctx, host=wcfg.kv_host, kv_dir=wcfg.kv_dir, name=wcfg.name
            )
        else:
            self.sender = make_sender(
                wcfg.transport,
                self._ctx,
                session=wcfg.session,
                worker=wcfg.index,
                timeout=wcfg.transfer_timeout,
            )
        self._sends: dict[str, SendKV] = {}  # where to send requests that have not parked yet
        self._events = self._new_events()

    def _new_events(self) -> KVEvents:
        return KVEvents(stats={})

    def warm_up(self) -> None:
        super().warm_up()  # as a plain engine: nothing is parked during warm-up
        self.engine.role, self.engine.replica = self.wcfg.role, self.wcfg.index

    def ready_message(self, cfg: ipc.CoreConfig) -> Any:
        return WorkerReady(
            self.info(cfg),
            engine_core.stats_dict(self.engine),
            self.receiver.address if self.receiver is not None else None,
            sorted(os.sched_getaffinity(0)),
        )

    def extra_sockets(self) -> list[zmq.Socket]:
        return [self.receiver.socket] if self.receiver is not None else []

    def idle_poll_ms(self) -> int:
        if self.sender is not None and self.sender.backlog:
            return _BACKLOG_POLL_MS
        if self.engine.num_reserved or self.engine.num_parked:
            return _DEADLINE_POLL_MS
        return super().idle_poll_ms()

    # ---- inputs ----

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, ImportKV):
            deadline = time.monotonic() + self.wcfg.reservation_timeout
            result = self.engine.reserve_import(msg, deadline)
            if isinstance(result, Reserved):
                self._events.reserved.append(result)
            else:
                self._events.refused.append(result)
        elif isinstance(msg, SendKV):
            if self.engine.is_parked(msg.request_id):
                self._send_kv(msg)
            elif self.engine.get_request(msg.request_id) is not None:
                self._sends[msg.request_id] = msg  # sent when it parks
            else:
                error = f"request {msg.request_id!r} is not on this prefill worker (aborted?)"
                self._events.failed.append(Failed(msg.request_id, "send", error))
        else:
            super()._handle(msg)

    def _send_kv(self, msg: SendKV) -> None:
        assert self.sender is not None
        sender = self.sender

        def send(header: wire.KVHeader, blocks: list[Any]) -> int:
            return sender.send(msg.address, header, blocks)

        try:
            sent = self.engine.send_kv(
                msg.request_id, msg.skip_blocks, send, self.wcfg.index, msg.decode_worker
            )
        except TransferError as e:
            self._events.failed.append(Failed(msg.request_id, "send", str(e)))
            return
        self._events.sent.append(sent)

    # ---- transfers and deadlines ----

    def service(self) -> bool:
        if self.receiver is not None:
            for payload in self.receiver.receive():
                self._commit(payload)
            for rid, error in self.engine.expire_reservations(time.monotonic()):
                self._events.failed.append(Failed(rid, "timeout", error))
        if self.sender is not None:
            self.sender.housekeeping(time.monotonic())
        return self._flush_events()

    def _commit(self, payload: Any) -> None:
        rid = payload.header.request_id
        try:
            if payload.error is not None:
                error = f"KV transfer of request {rid!r} failed: {payload.error}"
                if self.engine.get_request(rid) is not None:
                    self.engine.fail_request(rid, error)
                    self._events.failed.append(Failed(rid, "receive", error))
                return
            imported = self.engine.commit_import(
                payload.header, payload.blocks, payload.received_at
            )
            self._events.imported.append(imported)
        except KeyError:
            log.debug("KV payload for %s ignored: no reservation (aborted or expired)", rid)
        except TransferError as e:
            self._events.failed.append(Failed(rid, "corrupt", str(e)))
        finally:
            payload.release()

    def after_batch(self) -> None:
        parked = self.engine.take_parked()
        self._events.parked.extend(parked)
        for p in parked:
            msg = self._sends.pop(p.request_id, None)
            if msg is not None:
                self._send_kv(msg)
        if self._sends:  # requests that finished at their first token or were aborted
            self._sends = {rid: m for rid, m in self._sends.items() if self.engine.get_request(rid)}
        self._flush_events()

    def _flush_events(self) -> bool:
        if not self._events:
            return False
        self._events.stats = engine_core.stats_dict(self.engine)
        self.outputs.send(wire.encode(self._events))
        self._events = self._new_events()
        return True

    def run(self) -> None:
        try:
            super().run()
        finally:
            for part in (self.sender, self.receiver):
                if part is not None:
                    part.close()
            self._ctx.destroy(linger=0)


def main() -> int:
    wcfg = msgspec.json.decode(sys.stdin.buffer.read(), type=WorkerConfig)
    logging.basicConfig(  # before the core's own set-up, so every line names the worker
        level=wcfg.core.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [{wcfg.name}] %(message)s",
        stream=sys.stderr,
    )
    if wcfg.cpus:
        os.sched_setaffinity(0, wcfg.cpus)  # before torch creates its thread pools

    def make_core(engine: Any, inputs: Any, outputs: Any, parent_pid: int) -> WorkerCore:
        return WorkerCore(engine, inputs, outputs, parent_pid, wcfg)

    return engine_core.run_core(wcfg.core, make_core)


if __name__ == "__main__":
    sys.exit(main())
