"""The workload and load options `servelab bench` and `servelab sim` share: one declaration
and one help text each, grouped in help panels, and the one way they become a
``LoadSpec`` (whose ``from_flags`` holds the rules)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any

import typer

from servelab.cli.errors import bad_flag, seconds

if TYPE_CHECKING:
    from servelab.bench.workloads.request_plan import LoadSpec

TARGET = "Target"
WORKLOAD = "Workload"
LOAD = "Load"
LENGTH = "Run length"
SLO_SEARCH = "SLOs and search"
OUTPUT = "Output"


Workload = Annotated[
    str | None,
    typer.Option(
        help="Preset (chat, rag, agent, codegen, mixed, batch) or a YAML/TOML spec file. "
        "Default: chat.",
        rich_help_panel=WORKLOAD,
    ),
]
Trace = Annotated[
    str | None,
    typer.Option(
        help="Replay a trace (instead of --workload): azure-2023-conv, mooncake-synthetic, "
        "or an Azure CSV / Mooncake JSONL file.",
        rich_help_panel=WORKLOAD,
    ),
]
TimeScale = Annotated[
    float,
    typer.Option(help="Trace: multiply send times (2 = half the rate).", rich_help_panel=WORKLOAD),
]
LengthScale = Annotated[
    float,
    typer.Option(help="Multiply every token length (workload or trace).", rich_help_panel=WORKLOAD),
]
Seed = Annotated[
    int,
    typer.Option(
        help="Seed of the whole plan (arrivals, classes, lengths, text).", rich_help_panel=WORKLOAD
    ),
]
Endpoint = Annotated[
    str,
    typer.Option(help="completions or chat.", rich_help_panel=TARGET),
]
Concurrency = Annotated[
    int | None,
    typer.Option(help="Closed loop: this many requests in flight.", rich_help_panel=LOAD),
]
Rate = Annotated[
    float | None,
    typer.Option(
        help="Open loop: requests (sessions) per second; inf sends all at once. With --trace: "
        "the mean rate to scale it to.",
        rich_help_panel=LOAD,
    ),
]
Burstiness = Annotated[
    float,
    typer.Option(
        help="Gamma arrivals: CV = 1/sqrt(B); 1 is Poisson, below 1 is burstier.",
        rich_help_panel=LOAD,
    ),
]
Arrival = Annotated[
    str, typer.Option(help="poisson, gamma, constant, onoff or ramp.", rich_help_panel=LOAD)
]
OnOff = Annotated[
    str | None,
    typer.Option(help="onoff arrivals: ON,OFF seconds, e.g. 5s,10s.", rich_help_panel=LOAD),
]
RampTo = Annotated[
    float | None,
    typer.Option(
        help="ramp arrivals: the rate reached after --ramp-over (from --rate).",
        rich_help_panel=LOAD,
    ),
]
RampOver = Annotated[
    str | None, typer.Option(help="ramp duration (default: --duration).", rich_help_panel=LOAD)
]
Requests = Annotated[
    int | None,
    typer.Option(
        help="Stop after this many requests (sessions). Default, without --duration: 20 "
        "(10 per stage of a sweep or search).",
        rich_help_panel=LENGTH,
    ),
]
Duration = Annotated[
    str | None,
    typer.Option(help="Stop sending after this long (60, 60s, 2min).", rich_help_panel=LENGTH),
]
Slo = Annotated[
    str | None,
    typer.Option(
        help="SLOs for every class, e.g. ttft=2s,itl=250ms (overrides the workload's).",
        rich_help_panel=SLO_SEARCH,
    ),
]


def load_spec(
    flags: Mapping[str, Any], sweep: tuple[str, list[float]] | None = None, search: bool = False
) -> LoadSpec:
    """The load that the shared options among a command's parsed ``flags`` ask for.

    Raises typer's BadParameter for a time it cannot read, ValueError for a load
    ``LoadSpec.from_flags`` refuses.
    """
    from servelab.bench.workloads.request_plan import LoadSpec

    on = off = None
    if flags["on_off"] is not None:
        parts = flags["on_off"].split(",")
        if len(parts) != 2:
            raise bad_flag("--on-off", f"{flags['on_off']!r}: write ON,OFF durations, e.g. 5s,10s")
        on, off = seconds("--on-off", parts[0]), seconds("--on-off", parts[1])
    return LoadSpec.from_flags(
        concurrency=flags["concurrency"],
        rate=flags["rate"],
        arrival=flags["arrival"],
        burstiness=flags["burstiness"],
        on=on,
        off=off,
        ramp_to=flags["ramp_to"],
        ramp_over=seconds("--ramp-over", flags["ramp_over"]),
        requests=flags["requests"],
        duration=seconds("--duration", flags["duration"]),
        trace=flags["trace"],
        time_scale=flags["time_scale"],
        length_scale=flags["length_scale"],
        sweep=sweep,
        search=search,
    )
