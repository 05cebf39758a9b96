"""The disaggregated server's workers as the router sees them: one engine-core process each, in
the prefill or the decode role, with what the router last heard from it."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from servelab.server import ipc
from servelab.server.core_process import CoreProcess
from servelab.server.disagg import wire
from servelab.server.disagg.cpus import describe, split_cpus, usable_cpus
from servelab.server.disagg.wire import WorkerConfig, WorkerReady
from servelab.server.server_args import ServerArgs


@dataclass
class Worker:
    index: int
    role: str
    name: str
    proc: CoreProcess
    config: WorkerConfig
    ready: WorkerReady | None = None
    alive: bool = False
    dead_reason: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    busy: float = 0.0
    idle: float = 0.0
    outstanding: int = 0  # prefill: routed here, not yet parked or finished
    free_blocks: int = 0  # decode: last reported
    asked: dict[str, int] = field(default_factory=dict)  # decode: unanswered reservations
    refused: bool = False  # decode: refused since its last report
    adds_sent: int = 0
    adds_seen: int = 0
    calls: dict[int, asyncio.Future[Any]] = field(default_factory=dict)

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def update(self, stats: dict[str, Any]) -> None:
        self.stats = stats
        self.free_blocks = stats["kv_blocks_total"] - stats["kv_blocks_used"]

    def describe(self) -> dict[str, Any]:
        info = self.ready.info if self.ready else None
        return {
            "index": self.index,
            "name": self.name,
            "role": self.role,
            "pid": self.pid,
            "alive": self.alive,
            "error": self.dead_reason,
            "torch_threads": info.torch_threads if info else self.config.core.torch_threads,
            "cpu_kernels": info.cpu_kernels if info else None,
            "cpus": self.ready.cpus if self.ready else self.config.cpus,
            "kv_address": self.ready.kv_address if self.ready else None,
            "num_kv_blocks": info.num_kv_blocks if info else None,
            "kv_blocks_used": self.stats.get("kv_blocks_used"),
            "num_running": self.stats.get("num_running"),
            "num_waiting": self.stats.get("num_waiting"),
        }


def make_workers(
    a: ServerArgs, kv_dir: str, session: str, engine_factory: str | None
) -> tuple[list[Worker], str]:
    """One (unstarted) worker per prefill and decode worker the flags ask for, with their CPU
    split; and that split in words."""
    roles = ["prefill"] * a.prefill_workers + ["decode"] * a.decode_workers
    names = [
        f"{role}-{i if role == 'prefill' else i - a.prefill_workers}"
        for i, role in enumerate(roles)
    ]
    plan = split_cpus(usable_cpus(), len(roles), a.threads)
    engine = dataclasses.asdict(a.engine_config())
    workers = []
    for i, (role, name, cpus) in enumerate(zip(roles, names, plan)):
        proc = CoreProcess(
            "servelab.server.disagg.worker_process", wire.decode_worker_output, f"{name} worker"
        )
        core = ipc.CoreConfig(
            model=a.model,
            engine=engine,
            inputs_addr=proc.inputs_addr,
            outputs_addr=proc.outputs_addr,
            device=a.device,
            torch_threads=cpus.threads,
            log_level=a.log_level,
            engine_factory=engine_factory or "servelab.server.disagg.worker_process:build_engine",
        )
        cfg = WorkerConfig(
            core=core,
            role=role,
            index=i,
            name=name,
            transport=a.kv_transport,
            kv_host=a.kv_host,
            kv_dir=kv_dir,
            session=session,
            transfer_timeout=a.kv_transfer_timeout,
            # The router times hand-offs out; a decode worker's own limit is a backstop.
            reservation_timeout=a.kv_handoff_timeout + 2 * a.kv_transfer_timeout,
            cpus=cpus.cpus,
        )
        workers.append(Worker(i, role, name, proc, cfg))
    return workers, describe(plan, names)
