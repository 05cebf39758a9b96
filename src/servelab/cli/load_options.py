"""The workload and load options `servelab bench` and `servelab sim` share: one record,
``LoadFlags``, whose fields both commands' flag records take in (one declaration and one
help text each, grouped in help panels), and the one way they become a ``LoadSpec``
(whose ``from_flags`` holds the rules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from servelab.cli.errors import bad_flag, seconds
from servelab.cli.field_options import flag

if TYPE_CHECKING:
    from servelab.bench.workloads.request_plan import LoadSpec

TARGET = "Target"
WORKLOAD = "Workload"
LOAD = "Load"
LENGTH = "Run length"
SLO_SEARCH = "SLOs and search"
OUTPUT = "Output"


@dataclass(frozen=True)
class LoadFlags:
    """The shared options, in the order each command lists them within its panels."""

    endpoint: str = flag("completions", "completions or chat.", panel=TARGET)
    workload: str | None = flag(
        None,
        "Preset (chat, rag, agent, codegen, mixed, batch) or a YAML/TOML spec file. Default: chat.",
        panel=WORKLOAD,
    )
    trace: str | None = flag(
        None,
        "Replay a trace (instead of --workload): azure-2023-conv, mooncake-synthetic, "
        "or an Azure CSV / Mooncake JSONL file (sim: also a run directory, replayed as it ran).",
        panel=WORKLOAD,
    )
    time_scale: float = flag(1.0, "Trace: multiply send times (2 = half the rate).", panel=WORKLOAD)
    length_scale: float = flag(
        1.0, "Multiply every token length (workload or trace).", panel=WORKLOAD
    )
    seed: int = flag(
        0, "Seed of the whole plan (arrivals, classes, lengths, text).", panel=WORKLOAD
    )
    concurrency: int | None = flag(None, "Closed loop: this many requests in flight.", panel=LOAD)
    rate: float | None = flag(
        None,
        "Open loop: requests (sessions) per second; inf sends all at once. With --trace: "
        "the mean rate to scale it to.",
        panel=LOAD,
    )
    burstiness: float = flag(
        1.0, "Gamma arrivals: CV = 1/sqrt(B); 1 is Poisson, below 1 is burstier.", panel=LOAD
    )
    arrival: str = flag("poisson", "poisson, gamma, constant, onoff or ramp.", panel=LOAD)
    on_off: str | None = flag(None, "onoff arrivals: ON,OFF seconds, e.g. 5s,10s.", panel=LOAD)
    ramp_to: float | None = flag(
        None, "ramp arrivals: the rate reached after --ramp-over (from --rate).", panel=LOAD
    )
    ramp_over: str | None = flag(None, "ramp duration (default: --duration).", panel=LOAD)
    requests: int | None = flag(
        None,
        "Stop after this many requests (sessions). Default, without --duration: 20 "
        "(10 per stage of a sweep or search).",
        panel=LENGTH,
    )
    duration: str | None = flag(None, "Stop sending after this long (60, 60s, 2min).", panel=LENGTH)
    slo: str | None = flag(
        None,
        "SLOs for every class, e.g. ttft=2s,itl=250ms (overrides the workload's).",
        panel=SLO_SEARCH,
    )

    def load_spec(
        self, sweep: tuple[str, list[float]] | None = None, search: bool = False
    ) -> LoadSpec:
        """The load these options ask for.

        Raises typer's BadParameter for a time it cannot read, ValueError for a load
        ``LoadSpec.from_flags`` refuses.
        """
        from servelab.bench.workloads.request_plan import LoadSpec

        on = off = None
        if self.on_off is not None:
            parts = self.on_off.split(",")
            if len(parts) != 2:
                raise bad_flag("--on-off", f"{self.on_off!r}: write ON,OFF durations, e.g. 5s,10s")
            on, off = seconds("--on-off", parts[0]), seconds("--on-off", parts[1])
        return LoadSpec.from_flags(
            concurrency=self.concurrency,
            rate=self.rate,
            arrival=self.arrival,
            burstiness=self.burstiness,
            on=on,
            off=off,
            ramp_to=self.ramp_to,
            ramp_over=seconds("--ramp-over", self.ramp_over),
            requests=self.requests,
            duration=seconds("--duration", self.duration),
            trace=self.trace,
            time_scale=self.time_scale,
            length_scale=self.length_scale,
            sweep=sweep,
            search=search,
        )
