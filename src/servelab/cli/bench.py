"""`servelab bench`: the workload-shaped benchmark. No heavy imports at module level."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import typer

from servelab.cli.errors import bad_flag, fail, seconds

_TARGET = "Target"
_WORKLOAD = "Workload"
_LOAD = "Load"
_LENGTH = "Run length"
_SLO = "SLOs and search"
_OUTPUT = "Output"
_DATASET = "Dataset and sampling"


def parse_output_len(text: str) -> str | int:
    """``dataset``, ``natural`` or a number of tokens."""
    if text in ("dataset", "natural"):
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise bad_flag(
            "--output-len", f"{text!r}: give dataset, natural or a number of tokens >= 1"
        )
    return n


def parse_extra_body(text: str | None) -> dict[str, object]:
    """A JSON object merged into every request body."""
    if text is None:
        return {}
    import json

    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad_flag("--extra-body", f"not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(body, dict):
        raise bad_flag("--extra-body", "give a JSON object, e.g. '{\"seed\": 1}'")
    return body


def parse_sweep(text: str) -> tuple[str, list[float]]:
    """``"rate=0.5,1,2"`` or ``"concurrency=1,4,16"`` -> (kind, values)."""
    kind, sep, values = text.partition("=")
    kind = kind.strip()
    hint = "write --sweep rate=0.5,1,2 or --sweep concurrency=1,4,16"
    if not sep or kind not in ("rate", "concurrency"):
        raise bad_flag("--sweep", f"{text!r}: {hint}")
    try:
        vals = [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise bad_flag("--sweep", f"{text!r}: values must be numbers; {hint}") from None
    if not vals or any(not v > 0 for v in vals):
        raise bad_flag("--sweep", f"{text!r}: give one or more values > 0; {hint}")
    if kind == "concurrency" and any(v != int(v) for v in vals):
        raise bad_flag("--sweep", f"{text!r}: concurrency values must be whole numbers")
    return kind, vals


def bench(
    url: str | None = typer.Option(
        None,
        help="Base URL of an OpenAI-compatible server. Default: start `servelab serve`.",
        rich_help_panel=_TARGET,
    ),
    model: str | None = typer.Option(
        None,
        help="Model to serve (embedded) or to name in requests (default: the server's first).",
        rich_help_panel=_TARGET,
    ),
    tokenizer: str | None = typer.Option(
        None,
        help="Tokenizer for exact prompt lengths: a model name, HF dir or .gguf "
        "(default: the embedded model's).",
        rich_help_panel=_TARGET,
    ),
    api_key: str | None = typer.Option(
        None,
        envvar=["OPENAI_API_KEY", "SERVELAB_API_KEY"],
        show_default=False,
        show_envvar=True,
        help="Bearer token; never written to the run directory.",
        rich_help_panel=_TARGET,
    ),
    endpoint: str = typer.Option(
        "completions", help="completions or chat.", rich_help_panel=_TARGET
    ),
    engine_args: str = typer.Option(
        "",
        help='Flags for the embedded `servelab serve`, e.g. "--max-num-seqs 8".',
        rich_help_panel=_TARGET,
    ),
    strict_openai: bool = typer.Option(
        False,
        help="Send only OpenAI's own fields (no min_tokens/ignore_eos): output lengths "
        "are then not forced.",
        rich_help_panel=_TARGET,
    ),
    timeout: str = typer.Option(
        "600", help="Per-request timeout (seconds, or 10min).", rich_help_panel=_TARGET
    ),
    workload: str | None = typer.Option(
        None,
        help="Preset (chat, rag, agent, codegen, mixed, batch) or a YAML/TOML spec file. "
        "Default: chat.",
        rich_help_panel=_WORKLOAD,
    ),
    trace: str | None = typer.Option(
        None,
        help="Replay a trace (instead of --workload): azure-2023-conv, mooncake-synthetic, "
        "or an Azure CSV / Mooncake JSONL file.",
        rich_help_panel=_WORKLOAD,
    ),
    time_scale: float = typer.Option(
        1.0, help="Trace: multiply send times (2 = half the rate).", rich_help_panel=_WORKLOAD
    ),
    length_scale: float = typer.Option(
        1.0, help="Multiply every token length (workload or trace).", rich_help_panel=_WORKLOAD
    ),
    seed: int = typer.Option(
        0,
        help="Seed of the whole plan (arrivals, classes, lengths, text).",
        rich_help_panel=_WORKLOAD,
    ),
    dataset: str | None = typer.Option(
        None,
        help="Real prompts instead of synthetic text: a file (sharegpt JSON, openai-chat or "
        "openai-batch JSONL, jsonl, csv, parquet) or 'sharegpt' (the offline copy).",
        rich_help_panel=_DATASET,
    ),
    dataset_format: str | None = typer.Option(
        None, help="Override the detected dataset format.", rich_help_panel=_DATASET
    ),
    dataset_field: str | None = typer.Option(
        None,
        help="jsonl/csv/parquet: the prompt column (default: prompt).",
        rich_help_panel=_DATASET,
    ),
    conversation: str = typer.Option(
        "single-turn",
        help="single-turn (the first user turn) or multi-turn (each conversation as a session).",
        rich_help_panel=_DATASET,
    ),
    history: str = typer.Option(
        "recorded",
        help="multi-turn: send the recorded replies as history, or the model's own (generated).",
        rich_help_panel=_DATASET,
    ),
    output_len: str = typer.Option(
        "dataset",
        help="dataset (the recorded reply's length, forced), natural (not forced) or N tokens.",
        rich_help_panel=_DATASET,
    ),
    min_input_len: int | None = typer.Option(
        None, help="Drop dataset records with fewer prompt tokens.", rich_help_panel=_DATASET
    ),
    max_input_len: int | None = typer.Option(
        None, help="Drop dataset records with more prompt tokens.", rich_help_panel=_DATASET
    ),
    temperature: float | None = typer.Option(
        None, help="Sampling temperature sent with every request.", rich_help_panel=_DATASET
    ),
    top_p: float | None = typer.Option(
        None, help="Nucleus sampling top_p sent with every request.", rich_help_panel=_DATASET
    ),
    extra_body: str | None = typer.Option(
        None,
        help="JSON object merged into every request, e.g. '{\"seed\": 1}'.",
        rich_help_panel=_DATASET,
    ),
    concurrency: int | None = typer.Option(
        None, help="Closed loop: this many requests in flight.", rich_help_panel=_LOAD
    ),
    rate: float | None = typer.Option(
        None,
        help="Open loop: requests (sessions) per second; inf sends all at once.",
        rich_help_panel=_LOAD,
    ),
    burstiness: float = typer.Option(
        1.0,
        help="Gamma arrivals: CV = 1/sqrt(B); 1 is Poisson, below 1 is burstier.",
        rich_help_panel=_LOAD,
    ),
    arrival: str = typer.Option(
        "poisson", help="poisson, gamma, constant, onoff or ramp.", rich_help_panel=_LOAD
    ),
    on_off: str | None = typer.Option(
        None, help="onoff arrivals: ON,OFF seconds, e.g. 5s,10s.", rich_help_panel=_LOAD
    ),
    ramp_to: float | None = typer.Option(
        None,
        help="ramp arrivals: the rate reached after --ramp-over (from --rate).",
        rich_help_panel=_LOAD,
    ),
    ramp_over: str | None = typer.Option(
        None, help="ramp duration (default: --duration).", rich_help_panel=_LOAD
    ),
    requests: int | None = typer.Option(
        None, help="Stop after this many requests (sessions).", rich_help_panel=_LENGTH
    ),
    duration: str | None = typer.Option(
        None, help="Stop sending after this long (60, 60s, 2min).", rich_help_panel=_LENGTH
    ),
    warmup: str | None = typer.Option(
        None,
        help="Exclude from the measured window: 10s, 20 (requests) or 5%.",
        rich_help_panel=_LENGTH,
    ),
    cooldown: str | None = typer.Option(
        None, help="Exclude the end: 10s, 20 (requests) or 5%.", rich_help_panel=_LENGTH
    ),
    slo: str | None = typer.Option(
        None,
        help="SLOs for every class, e.g. ttft=2s,itl=250ms (overrides the workload's).",
        rich_help_panel=_SLO,
    ),
    sweep: str | None = typer.Option(
        None, help="Stages: rate=0.5,1,2 or concurrency=1,4,16.", rich_help_panel=_SLO
    ),
    find_max_rate: bool = typer.Option(
        False,
        help="Search the highest rate whose goodput fraction stays >= --goodput-target.",
        rich_help_panel=_SLO,
    ),
    goodput_target: float = typer.Option(
        0.9, help="Fraction of requests that must meet SLOs.", rich_help_panel=_SLO
    ),
    search_steps: int = typer.Option(
        3, help="Bisection stages after bracketing the max rate.", rich_help_panel=_SLO
    ),
    matrix: str | None = typer.Option(
        None, help="Run a matrix of configurations from a file.", rich_help_panel=_SLO
    ),
    out: str | None = typer.Option(
        None, help="Run directory (default: runs/<time>-<workload>).", rich_help_panel=_OUTPUT
    ),
    overwrite: bool = typer.Option(
        False, help="Replace a run already in --out.", rich_help_panel=_OUTPUT
    ),
    quiet: bool = typer.Option(False, help="No live progress display.", rich_help_panel=_OUTPUT),
    workers: int = typer.Option(
        1,
        help="Client worker processes sharing one schedule (for loads one process cannot "
        "drive); with --ray-address, Ray actors.",
        rich_help_panel=_LOAD,
    ),
    ray_address: str | None = typer.Option(
        None,
        help="Run the workers as Ray actors spread over this cluster: auto, HOST:PORT or "
        "ray://HOST:PORT (pip install 'servelab[ray]').",
        rich_help_panel=_LOAD,
    ),
    scrape_interval: str = typer.Option(
        "0.5s",
        help="How often the server's /metrics is scraped during the run (a time series of "
        "its queue, running count and KV usage).",
        rich_help_panel=_OUTPUT,
    ),
    slice_duration: str = typer.Option(
        "10s",
        help="Length of the time windows (timeslices) with their own percentiles, rates and "
        "queue depth; their trend says whether the run reached a steady state.",
        rich_help_panel=_OUTPUT,
    ),
) -> None:
    """Benchmark an OpenAI-compatible endpoint with a workload-shaped load."""
    from servelab.bench.manifest import redact
    from servelab.bench.plan import ENDPOINTS, LoadSpec
    from servelab.bench.run import BenchOptions, run_bench
    from servelab.units import SLO, Trim

    if url is not None and not url.startswith(("http://", "https://")):
        raise bad_flag("--url", f"{url!r}: give a base URL such as http://127.0.0.1:8000")
    if endpoint not in ENDPOINTS:
        raise bad_flag("--endpoint", f"{endpoint!r}: use completions or chat")
    if trace is not None and workload is not None:
        raise bad_flag("--trace", "a trace sets its own lengths and arrivals; drop --workload")
    if conversation not in ("single-turn", "multi-turn"):
        raise bad_flag("--conversation", f"{conversation!r}: use single-turn or multi-turn")
    if history not in ("recorded", "generated"):
        raise bad_flag("--history", f"{history!r}: use recorded or generated")
    if temperature is not None and temperature < 0:
        raise bad_flag("--temperature", f"{temperature}: give a number >= 0")
    if top_p is not None and not 0 < top_p <= 1:
        raise bad_flag("--top-p", f"{top_p}: give a number in (0, 1]")
    sampling = parse_extra_body(extra_body)
    if temperature is not None:
        sampling["temperature"] = temperature
    if top_p is not None:
        sampling["top_p"] = top_p
    source = None
    if dataset is not None:
        from servelab.bench.workload import DatasetSource

        try:
            source = DatasetSource(
                dataset=dataset,
                format=dataset_format,
                field=dataset_field,
                conversation=conversation,  # type: ignore[arg-type]
                history=history,  # type: ignore[arg-type]
                output_len=parse_output_len(output_len),
                min_input_len=min_input_len,
                max_input_len=max_input_len,
            )
        except ValueError as e:  # pydantic's ValidationError is one
            raise fail(f"invalid dataset flags: {e}", "bench") from None
    elif dataset_format or dataset_field or min_input_len or max_input_len:
        raise bad_flag("--dataset", "the --dataset-*/--*-input-len flags need --dataset SRC")
    if find_max_rate and sweep is not None:
        raise bad_flag("--find-max-rate", "choose --sweep or --find-max-rate, not both")
    if workers < 1:
        raise bad_flag("--workers", f"{workers}: give 1 or more")
    if ray_address is not None:
        from servelab.bench.distributed.ray_workers import check_address

        try:
            check_address(ray_address)
        except ValueError as e:
            raise bad_flag("--ray-address", str(e)) from None
    scrape_every = seconds("--scrape-interval", scrape_interval) or 0.0
    if not 0.05 <= scrape_every <= 60:
        raise bad_flag("--scrape-interval", f"{scrape_interval!r}: give 50ms to 60s")
    slice_s = seconds("--slice-duration", slice_duration) or 0.0
    if not 0.1 <= slice_s <= 3600:
        raise bad_flag("--slice-duration", f"{slice_duration!r}: give 100ms to 1h")
    if find_max_rate and concurrency is not None:
        raise bad_flag("--find-max-rate", "it searches over --rate (open loop); drop --concurrency")
    on = off = None
    if on_off is not None:
        parts = on_off.split(",")
        if len(parts) != 2:
            raise bad_flag("--on-off", f"{on_off!r}: write ON,OFF durations, e.g. 5s,10s")
        on, off = seconds("--on-off", parts[0]), seconds("--on-off", parts[1])
    if arrival == "poisson" and on_off is not None:
        arrival = "onoff"
    if arrival == "poisson" and ramp_to is not None:
        arrival = "ramp"
    sweep_spec = parse_sweep(sweep) if sweep else None
    if sweep_spec is not None and sweep_spec[0] == "rate" and rate is None:
        rate = sweep_spec[1][0]
    if sweep_spec is not None and sweep_spec[0] == "concurrency" and concurrency is None:
        concurrency = int(sweep_spec[1][0])
    if find_max_rate and rate is None:
        rate = 1.0
    if concurrency is None and rate is None and trace is None:
        concurrency = 1  # a sensible default: one request at a time
    load = LoadSpec(
        concurrency=concurrency,
        rate=rate,
        arrival=arrival,
        burstiness=burstiness,
        on=on,
        off=off,
        ramp_to=ramp_to,
        ramp_over=seconds("--ramp-over", ramp_over),
        requests=requests,
        duration=seconds("--duration", duration),
        trace=trace,
        time_scale=time_scale,
        length_scale=length_scale,
    )
    if load.requests is None and load.duration is None and trace is None:
        load.requests = 20 if sweep_spec is None and not find_max_rate else 10
    if rate is not None and math.isinf(rate) and (sweep_spec or find_max_rate):
        raise bad_flag("--rate", "inf cannot be swept or searched")
    try:
        load.validate()
        opts = BenchOptions(
            url=url,
            model=model,
            tokenizer=tokenizer,
            api_key=api_key or None,
            workload=workload,
            load=load,
            slo=SLO.parse(slo) if slo else None,
            sweep=sweep_spec,
            find_max_rate=find_max_rate,
            goodput_target=goodput_target,
            search_steps=search_steps,
            out=Path(out) if out else None,
            engine_args=engine_args,
            seed=seed,
            endpoint=endpoint,
            warmup=Trim.parse(warmup),
            cooldown=Trim.parse(cooldown),
            quiet=quiet,
            strict_openai=strict_openai,
            timeout=seconds("--timeout", timeout) or 600.0,
            command=redact(["servelab", *sys.argv[1:]]),
            overwrite=overwrite,
            workers=workers,
            ray_address=ray_address,
            dataset=source,
            sampling=sampling,
            scrape_interval=scrape_every,
            slice_duration=slice_s,
        )
    except ValueError as e:
        raise fail(str(e), "bench") from None
    if not 0 < goodput_target <= 1:
        raise bad_flag("--goodput-target", f"{goodput_target}: give a fraction in (0, 1]")
    if matrix is not None:
        from servelab.workflows.matrix import run_matrix

        raise typer.Exit(run_matrix(Path(matrix), opts))
    try:
        code = run_bench(opts)
    except (ValueError, RuntimeError) as e:
        raise fail(str(e), "bench") from None
    raise typer.Exit(code)


COMMANDS = {"bench": bench}
