"""Capacity planning on the simulator: the fewest replicas, the highest rate, the best P:D split.

A deployment *meets* the workload when at least ``target`` of its requests succeed and
meet every SLO of their class (SLO attainment, DistServe's criterion). Each search runs
whole simulations, deterministically, and returns every point it tried.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from servelab.sim.loop.simulation import SimResult, Topology
from servelab.sim.scenario import attainment, load_requests, simulate


@dataclass(kw_only=True)
class Point:
    """One simulated configuration and how it did."""

    label: str
    attainment: float
    goodput: float  # requests/s meeting their SLOs, over the simulated duration
    meets: bool
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "attainment": self.attainment,
            "goodput": self.goodput,
            "meets": self.meets,
            **self.extra,
        }


@dataclass
class CapacityResult:
    answer: Any  # the replica count, the rate, or (P, D); None when nothing met the target
    points: list[Point]
    target: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "answer": self.answer,
            "target": self.target,
            "points": [p.to_dict() for p in self.points],
        }


def _point(label: str, res: SimResult, slos: Any, target: float, **extra: Any) -> Point:
    att = attainment(res, slos)
    dur = res.sim_duration or 1.0
    e2e = [r.e2e for r in res.records if r.ok and r.e2e is not None]
    extra["mean_e2e"] = sum(e2e) / len(e2e) if e2e else None
    return Point(
        label=label,
        attainment=att,
        goodput=att * len(res.records) / dur,
        meets=att >= target,
        extra=extra,
    )


T = TypeVar("T", int, float)


def _bisect(
    meets: Callable[[T], bool],
    good: T,
    bad: T,
    close: Callable[[T, T], bool],
    mid: Callable[[T, T], T],
) -> T:
    """Narrow a bracket of ``good`` (meets) and ``bad`` (does not) by testing their ``mid``
    until the two are ``close``; return the last good value."""
    while not close(good, bad):
        m = mid(good, bad)
        if meets(m):
            good = m
        else:
            bad = m
    return good


def fewest_replicas(
    run: Callable[[int], SimResult], slos: Any, target: float = 0.9, max_replicas: int = 64
) -> CapacityResult:
    """The fewest replicas whose run meets ``target`` (doubling, then bisection)."""
    points: dict[int, Point] = {}

    def meets(n: int) -> bool:
        if n not in points:
            points[n] = _point(f"{n} replicas", run(n), slos, target, replicas=n)
        return points[n].meets

    hi = 1
    while not meets(hi):
        if hi >= max_replicas:
            return CapacityResult(None, [points[k] for k in sorted(points)], target)
        hi = min(hi * 2, max_replicas)
    lo = hi // 2  # fails (or 0)
    hi = _bisect(meets, hi, lo, lambda g, b: g - b <= 1, lambda g, b: (g + b) // 2)
    return CapacityResult(hi, [points[k] for k in sorted(points)], target)


def highest_rate(
    run: Callable[[float], SimResult],
    slos: Any,
    start: float,
    target: float = 0.9,
    rel_tol: float = 0.05,
    max_doublings: int = 12,
) -> CapacityResult:
    """The highest request rate that meets ``target``, to within ``rel_tol`` (bracket by
    halving or doubling from ``start``, then bisect)."""
    points: dict[float, Point] = {}

    def meets(rate: float) -> bool:
        if rate not in points:
            points[rate] = _point(f"{rate:.4g} req/s", run(rate), slos, target, rate=rate)
        return points[rate].meets

    lo, hi = None, None
    r = start
    for _ in range(max_doublings):
        if meets(r):
            lo = r
            if hi is not None:
                break
            r *= 2
        else:
            hi = r
            if lo is not None:
                break
            r /= 2
    if lo is None:
        return CapacityResult(None, [points[k] for k in sorted(points)], target)
    if hi is None:
        return CapacityResult(lo, [points[k] for k in sorted(points)], target)
    lo = _bisect(meets, lo, hi, lambda g, b: (b - g) / g <= rel_tol, lambda g, b: (g + b) / 2)
    return CapacityResult(lo, [points[k] for k in sorted(points)], target)


def best_pd_split(
    run: Callable[[int, int], SimResult], slos: Any, total: int, target: float = 0.9
) -> CapacityResult:
    """Every P:D split of ``total`` replicas. The best has the highest attainment, then the
    highest goodput, then the lowest mean end-to-end latency (when several meet the SLOs
    at this load, the fastest one has the most headroom)."""
    if total < 2:
        raise ValueError("a P:D split needs at least 2 replicas in total (--replicas 2 or more)")
    points = [
        _point(f"{p}P:{total - p}D", run(p, total - p), slos, target, prefill=p, decode=total - p)
        for p in range(1, total)
    ]

    def rank(pt: Point) -> tuple[float, float, float]:
        e2e = pt.extra["mean_e2e"]
        return (pt.attainment, round(pt.goodput, 3), -(e2e if e2e is not None else float("inf")))

    best = max(points, key=rank)
    return CapacityResult((best.extra["prefill"], best.extra["decode"]), points, target)


def find_capacity(
    kind: str,
    scenario: Any,
    workload: str | None,
    load: Any,
    seed: int,
    endpoint: str,
    target: float,
    max_replicas: int,
    replicas: int,
) -> tuple[CapacityResult, str]:
    """Run the ``kind`` search (replicas, rate or pd) around ``scenario``; return the result
    and what it searched for. Raises ValueError naming the flag that is missing or wrong."""
    topo = scenario.topology
    slos = scenario.slos
    if not slos or (isinstance(slos, dict) and all(s.empty for s in slos.values())):
        raise ValueError(
            "--find-capacity needs SLOs: the workload defines none; add --slo 'ttft=2s,itl=200ms'"
        )
    if kind == "replicas":
        result = fewest_replicas(
            lambda n: simulate(
                scenario.with_topology(dataclasses.replace(topo, replicas=n)), keep_steps=False
            ),
            slos,
            target,
            max_replicas,
        )
        what = "fewest replicas"
    elif kind == "rate":
        if load.rate is None:
            raise ValueError("--find-capacity rate needs a starting --rate")
        max_len = scenario.target.engine_config.max_model_len or scenario.target.max_model_len

        def at_rate(r: float) -> Any:
            reqs, _, _ = load_requests(
                workload,
                dataclasses.replace(load, rate=r),
                seed,
                max_len,
                endpoint,
                resend=scenario.target.resend,
                sim_seed=scenario.sim_seed,
            )
            return simulate(dataclasses.replace(scenario, requests=reqs), keep_steps=False)

        result = highest_rate(at_rate, slos, load.rate, target)
        what = "highest rate (req/s)"
    elif kind == "pd":
        link = topo.link
        if link is None:
            from servelab.sim.loop.links import parse_link

            link = parse_link("nvlink")
        result = best_pd_split(
            lambda p, d: simulate(
                scenario.with_topology(
                    Topology(prefill=p, decode=d, link=link, router=topo.router)
                ),
                keep_steps=False,
            ),
            slos,
            replicas,
            target,
        )
        what = f"best P:D split of {replicas} replicas"
    else:
        raise ValueError(f"--find-capacity {kind!r}: use replicas, rate or pd")
    return result, what
