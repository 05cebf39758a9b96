"""How the CPUs are divided between disaggregated workers. No torch.

Rule: one CPU (the first usable one) is left to the API/router process. If the rest give
every worker at least one CPU of its own, each worker is pinned to a disjoint, contiguous
slice of them and runs one torch thread per CPU of its slice, so prefill and decode never
compete for a core. Otherwise (e.g. 2 CPUs for 1 prefill + 1 decode worker) the workers are
not pinned and run one thread each: they share the cores with each other and with the API
process through the OS scheduler, which is what colocated serving does inside one step.
``threads`` (``--threads``) overrides the per-worker thread count in both cases.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerCPUs:
    cpus: list[int] | None  # affinity; None: inherit (not pinned)
    threads: int


def usable_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def split_cpus(cpus: list[int], num_workers: int, threads: int | None = None) -> list[WorkerCPUs]:
    """The CPU plan for ``num_workers`` workers over ``cpus`` (see the module docstring)."""
    if num_workers < 1:
        raise ValueError("need at least one worker")
    spare = cpus[1:]
    if len(spare) >= num_workers:
        per = len(spare) // num_workers
        return [
            WorkerCPUs(spare[i * per : (i + 1) * per], threads or per) for i in range(num_workers)
        ]
    return [WorkerCPUs(None, threads or 1) for _ in range(num_workers)]


def describe(plan: list[WorkerCPUs], names: list[str]) -> str:
    """One line for the log: who runs where."""
    parts = []
    for name, w in zip(names, plan):
        where = f"CPUs {','.join(map(str, w.cpus))}" if w.cpus else "shared CPUs"
        parts.append(f"{name}: {w.threads} thread(s) on {where}")
    return "; ".join(parts)
