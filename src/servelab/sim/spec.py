"""What one `servelab sim` run is asked to do, typed: the target, the topology, the load
and its workload, the search over them, and where the run goes.

The CLI builds a ``SimSpec`` from its flags (durations already in seconds); each part checks
what it can on its own and raises ValueError naming the flag to fix. ``sim.run.run_sim``
carries it out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from servelab.vocab import DEFAULT_MODEL

if TYPE_CHECKING:
    from servelab.bench.workloads.request_plan import LoadSpec

CAPACITY_SEARCHES = ("replicas", "rate", "pd")


@dataclass(frozen=True)
class TargetSpec:
    """What to simulate: ``hardware`` x ``model`` through the roofline (its efficiencies
    from a ``calibration`` file and the overrides), a measured ``profile``, or another
    server's twin (a twin ``calibration``). ``engine_args`` in `servelab serve`'s own
    spelling, plus ``--tp`` and ``--gpu-memory-utilization``; for the twin of vLLM, SGLang
    or llama-server, in that server's spelling (``sim.fit.twin.server_engine_args``)."""

    model: str = DEFAULT_MODEL
    hardware: str | None = None
    engine: str | None = None
    dtype: str | None = None
    kv_dtype: str | None = None
    profile: str | None = None
    calibration: str | None = None
    mfu: float | None = None
    mbu: float | None = None
    step_overhead: float | None = None  # seconds
    engine_args: str | None = None

    def roofline_given(self) -> list[str]:
        """The flags, among those a roofline target alone takes, that were given."""
        given = {
            "--hardware": self.hardware,
            "--profile": self.profile,
            "--engine": self.engine,
            "--dtype": self.dtype,
            "--kv-dtype": self.kv_dtype,
            "--mfu": self.mfu,
            "--mbu": self.mbu,
            "--step-overhead": self.step_overhead,
        }
        return [name for name, value in given.items() if value is not None]


@dataclass(frozen=True)
class TopologySpec:
    """How the replicas are deployed: ``replicas`` behind a ``router``, or ``pd`` (prefill,
    decode) replicas joined by ``link``; ``network_delay`` one way between the clients and
    the server (None: 0, or half a twin's measured API time)."""

    replicas: int = 1
    router: str = "round-robin"
    pd: tuple[int, int] | None = None
    link: str = "nvlink"
    network_delay: float | None = None  # seconds


def parse_pd(text: str | None) -> tuple[int, int] | None:
    """``"1:3"`` -> (1, 3); None stays None."""
    if text is None:
        return None
    p, _, d = text.partition(":")
    if not (p.isdigit() and d.isdigit()):
        raise ValueError(f"--pd {text!r}: write P:D, e.g. 1:3")
    return int(p), int(d)


@dataclass(frozen=True)
class WorkloadSpec:
    """The requests: a ``workload`` preset or spec file (None with no ``trace``: bench's
    default), the ``load`` they arrive under, the plan's ``seed``, the simulator's own
    ``sim_seed``, the ``endpoint`` and an ``slo`` over every class."""

    load: LoadSpec
    workload: str | None = None
    seed: int = 0
    sim_seed: int = 0
    endpoint: str = "completions"
    slo: str | None = None

    def workload_or_default(self) -> str | None:
        """``workload``, or bench's default one where neither it nor a trace is given."""
        if self.workload is not None or self.load.trace is not None:
            return self.workload
        from servelab.bench.run import DEFAULT_WORKLOAD

        return DEFAULT_WORKLOAD


@dataclass(frozen=True)
class SearchSpec:
    """What to vary: ``sweep`` engine args (a cross product), or ``find_capacity`` (replicas,
    rate or pd) meeting ``attainment_target``; ``seeds`` simulator seeds per run."""

    sweep: tuple[str, ...] = ()
    find_capacity: str | None = None
    attainment_target: float = 0.9
    max_replicas: int = 64
    seeds: int = 1

    def __post_init__(self) -> None:
        if self.find_capacity is not None and self.sweep:
            raise ValueError("use --find-capacity or --sweep, not both")
        if self.seeds < 1:
            raise ValueError("--seeds must be >= 1")


@dataclass(frozen=True)
class OutputSpec:
    """The run directory (in a sweep, the parent of one per point) and whether it gets the
    engine's steps."""

    out: Path
    write_steps: bool = True


@dataclass(frozen=True)
class SimSpec:
    """One `servelab sim` run."""

    target: TargetSpec
    topology: TopologySpec
    workload: WorkloadSpec
    search: SearchSpec
    output: OutputSpec
