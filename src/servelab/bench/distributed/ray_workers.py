"""Workers as Ray actors, spread over a cluster's nodes.

``start_ray_workers(n, target, address, tag)`` connects to the cluster (``auto``,
``HOST:PORT`` or ``ray://HOST:PORT``; a Ray already initialised in this process is used
as it is), checks that it has a CPU per worker, and places ``n`` actors
(``BenchActor``, each holding a ``BenchWorkerCore``) with one CPU each and the SPREAD
strategy, so they land on different nodes where there are several. Stage events come
back through a streaming generator (``events``). An actor that dies makes its calls
and its event stream raise ``WorkerLost``.

Ray is optional (``pip install 'servelab[ray]'``) and imported only here, lazily. Every
node needs servelab installed in the same Python environment as the driver.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

from servelab.bench.client.send import Target
from servelab.bench.distributed.bench_worker import BenchWorkerCore
from servelab.bench.distributed.messages import StageJob, WorkerCalls, WorkerInfo, WorkerLost
from servelab.bench.workloads.request_plan import PlannedRequest

ACTOR_READY_TIMEOUT_S = 120.0
CONNECT_CHECK_TIMEOUT_S = 5.0
_ADDRESS_RE = re.compile(r"^(ray://)?([A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:]+\]):(\d{1,5})$")
_INSTALL = "pip install 'servelab[ray]'"


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RuntimeError(
            f"--ray-address needs Ray, which is not installed here: {_INSTALL} "
            "(or drop --ray-address to run --workers as local processes)"
        ) from None
    return ray


def check_address(address: str) -> None:
    """Raise ValueError unless ``address`` is ``auto``, ``HOST:PORT`` or ``ray://HOST:PORT``."""
    if address != "auto" and not _ADDRESS_RE.match(address):
        raise ValueError(
            f"--ray-address {address!r}: give auto (the cluster this machine belongs to), "
            "HOST:PORT (the head node's GCS port, 6379 by default) or ray://HOST:10001 "
            "(Ray Client)"
        )


def _reachable(address: str) -> None:
    """Fail fast on an explicit address nobody answers at (Ray itself retries for minutes)."""
    m = _ADDRESS_RE.match(address)
    if m is None:
        return
    host, port = m.group(2).strip("[]"), int(m.group(3))
    try:
        socket.create_connection((host, port), timeout=CONNECT_CHECK_TIMEOUT_S).close()
    except OSError as e:
        raise RuntimeError(
            f"cannot reach the Ray cluster at {address}: {e}. Check that the cluster is "
            "running (`ray status` on its head node; `ray start --head` starts one) and that "
            "this machine can reach that host and port"
        ) from None


def _connect(ray: Any, address: str) -> bool:
    """Connect this process to the cluster; True if this call did (and so should disconnect)."""
    if ray.is_initialized():
        return False
    _reachable(address)
    try:
        ray.init(address=address, logging_level=logging.WARNING, namespace="servelab")
    except (ConnectionError, TimeoutError, RuntimeError, ValueError) as e:
        hint = (
            "; Ray Client addresses (ray://) also need pip install 'ray[client]'"
            if address.startswith("ray://")
            else ""
        )
        raise RuntimeError(
            f"cannot connect to the Ray cluster at {address!r}: {e}. Check that it is "
            f"running (`ray status` on its head node; `ray start --head` starts one){hint}"
        ) from None
    return True


class BenchActor:
    """The actor body: a ``BenchWorkerCore`` behind Ray's async actor methods."""

    def __init__(self, index: int, target: Target) -> None:
        self.core = BenchWorkerCore(index, target)

    async def info(self) -> WorkerInfo:
        return self.core.info()

    async def ping(self) -> tuple[float, str | None]:
        return self.core.ping()

    async def setup(self, job: StageJob) -> None:
        self.core.setup(job)

    async def feed(self, sessions: list[list[PlannedRequest]], end: bool = False) -> None:
        self.core.feed(sessions, end)

    async def start(self, at: float) -> None:
        self.core.start(at)

    async def stop(self) -> None:
        self.core.stop()

    async def events(self) -> AsyncIterator[list[tuple[str, Any]]]:
        while (batch := await self.core.next_batch()) is not None:
            yield batch

    async def close(self) -> None:
        await self.core.close()


class RayWorker(WorkerCalls):
    """The driver's handle on one ``BenchActor``."""

    kind = "ray"

    def __init__(self, ray: Any, actor: Any, info: WorkerInfo, name: str) -> None:
        self._ray = ray
        self.actor = actor
        self.info = info
        self.name = name
        self.lost: str | None = None

    @property
    def alive(self) -> bool:
        return self.lost is None

    def describe(self) -> str:
        return f"{self.info.describe()} (Ray actor {self.name})"

    def _gone(self, e: Exception) -> WorkerLost:
        self.lost = f"{self.describe()} died: {str(e).splitlines()[0]}"
        return WorkerLost(self.lost)

    async def _call(self, method: str, *args: Any) -> Any:
        if self.lost is not None:
            raise WorkerLost(self.lost)
        try:
            return await getattr(self.actor, method).remote(*args)
        except self._ray.exceptions.RayActorError as e:
            raise self._gone(e) from None

    async def events(self) -> AsyncIterator[list[tuple[str, Any]]]:
        if self.lost is not None:
            raise WorkerLost(self.lost)
        try:
            gen = self.actor.events.options(num_returns="streaming").remote()
            async for ref in gen:
                yield await ref
        except self._ray.exceptions.RayActorError as e:
            raise self._gone(e) from None

    async def close(self) -> None:
        if self.lost is None:
            try:
                await asyncio.wait_for(self._call("close"), 10.0)
            except (WorkerLost, asyncio.TimeoutError):
                pass
        self._ray.kill(self.actor, no_restart=True)


async def start_ray_workers(
    n: int, target: Target, address: str, tag: str
) -> tuple[list[RayWorker], Callable[[], None]]:
    """Place ``n`` actors; returns them and a function that disconnects from the cluster."""
    check_address(address)
    ray = _import_ray()
    connected = _connect(ray, address)

    def disconnect() -> None:
        if connected:
            ray.shutdown()

    try:
        cpus = ray.cluster_resources().get("CPU", 0.0)
        if cpus < n:
            raise RuntimeError(
                f"the Ray cluster has {cpus:g} CPUs and --workers {n} needs one per worker: "
                "give fewer workers or add nodes"
            )
        remote = ray.remote(num_cpus=1, max_restarts=0, max_task_retries=0)(BenchActor)
        names = [f"servelab-bench-{tag}-w{i}" for i in range(n)]
        actors = [
            remote.options(name=name, scheduling_strategy="SPREAD").remote(i, target)
            for i, name in enumerate(names)
        ]
        try:
            infos = await asyncio.wait_for(
                asyncio.gather(*(a.info.remote() for a in actors)), ACTOR_READY_TIMEOUT_S
            )
        except (asyncio.TimeoutError, ray.exceptions.RayError) as e:
            for a in actors:
                ray.kill(a, no_restart=True)
            why = (
                f"did not start within {ACTOR_READY_TIMEOUT_S:g} s"
                if isinstance(e, asyncio.TimeoutError)
                else f"failed to start: {str(e).splitlines()[0]}"
            )
            raise RuntimeError(
                f"the Ray workers {why}; check `ray status` (free CPUs) and that servelab "
                "is installed in the same Python environment on every node"
            ) from None
        return [RayWorker(ray, a, info, name) for a, info, name in zip(actors, infos, names)], (
            disconnect
        )
    except BaseException:
        disconnect()
        raise
