"""`servelab bench`: the workload-shaped benchmark. No heavy imports at module level.

Parse -> spec -> call: typer parses the options (the workload and load ones shared with
`servelab sim`, from ``servelab.cli.load_options``), ``bench_options`` turns them into a
``BenchOptions`` (its load from ``LoadSpec.from_flags``, which holds the load rules;
``BenchOptions.validate`` the rest), and ``run_bench`` runs it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from servelab.cli import load_options as opt
from servelab.cli.errors import bad_flag, fail, seconds
from servelab.cli.extras import require_engine

if TYPE_CHECKING:
    from servelab.bench.run import BenchOptions
    from servelab.bench.workloads.spec import DatasetSource

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


Url = Annotated[
    str | None,
    typer.Option(
        help="Base URL of an OpenAI-compatible server. Default: start `servelab serve`.",
        rich_help_panel=opt.TARGET,
    ),
]
Model = Annotated[
    str | None,
    typer.Option(
        help="Model to serve (embedded) or to name in requests (default: the server's first).",
        rich_help_panel=opt.TARGET,
    ),
]
Tokenizer = Annotated[
    str | None,
    typer.Option(
        help="Tokenizer for exact prompt lengths: a model name, HF dir or .gguf, or 'server' "
        "(the server's POST /tokenize). Default: --model's where servelab can read it, else "
        "the server's /tokenize (vLLM, SGLang, llama.cpp), else the default model's.",
        rich_help_panel=opt.TARGET,
    ),
]
ApiKey = Annotated[
    str | None,
    typer.Option(
        envvar=["OPENAI_API_KEY", "SERVELAB_API_KEY"],
        show_default=False,
        show_envvar=True,
        help="Bearer token; never written to the run directory.",
        rich_help_panel=opt.TARGET,
    ),
]
EngineArgs = Annotated[
    str,
    typer.Option(
        help='Flags for the embedded `servelab serve`, e.g. "--max-num-seqs 8".',
        rich_help_panel=opt.TARGET,
    ),
]
ServerConfig = Annotated[
    str | None,
    typer.Option(
        help="Another server's launch command or flags, e.g. 'vllm serve M "
        "--no-enable-chunked-prefill': recorded (secrets redacted) so diagnosis and "
        "calibrate know its settings.",
        rich_help_panel=opt.TARGET,
    ),
]
StrictOpenai = Annotated[
    bool,
    typer.Option(
        help="Send only OpenAI's own fields (no min_tokens/ignore_eos): output lengths "
        "are then not forced.",
        rich_help_panel=opt.TARGET,
    ),
]
NoRequestIdHeader = Annotated[
    bool,
    typer.Option(
        "--no-request-id-header",
        help="Send no X-Request-Id (by default each request carries a UUID the server's own "
        "logs can be joined by; a server that refuses it is detected and reported anyway).",
        rich_help_panel=opt.TARGET,
    ),
]
ColdConnections = Annotated[
    bool,
    typer.Option(
        "--cold-connections",
        help="Open each stream's connection inside the measured window, its set-up counted in "
        "TTFT (by default they are opened before the clock starts, and the set-up recorded apart).",
        rich_help_panel=opt.TARGET,
    ),
]
Timeout = Annotated[
    str, typer.Option(help="Per-request timeout (seconds, or 10min).", rich_help_panel=opt.TARGET)
]
Dataset = Annotated[
    str | None,
    typer.Option(
        help="Real prompts instead of synthetic text: a file (sharegpt JSON, openai-chat or "
        "openai-batch JSONL, jsonl, csv, parquet) or 'sharegpt' (the offline copy).",
        rich_help_panel=_DATASET,
    ),
]
DatasetFormat = Annotated[
    str | None,
    typer.Option(help="Override the detected dataset format.", rich_help_panel=_DATASET),
]
DatasetField = Annotated[
    str | None,
    typer.Option(
        help="jsonl/csv/parquet: the prompt column (default: prompt).", rich_help_panel=_DATASET
    ),
]
Conversation = Annotated[
    str,
    typer.Option(
        help="single-turn (the first user turn) or multi-turn (each conversation as a session).",
        rich_help_panel=_DATASET,
    ),
]
History = Annotated[
    str,
    typer.Option(
        help="multi-turn: send the recorded replies as history, or the model's own (generated).",
        rich_help_panel=_DATASET,
    ),
]
OutputLen = Annotated[
    str,
    typer.Option(
        help="dataset (the recorded reply's length, forced), natural (not forced) or N tokens.",
        rich_help_panel=_DATASET,
    ),
]
MinInputLen = Annotated[
    int | None,
    typer.Option(help="Drop dataset records with fewer prompt tokens.", rich_help_panel=_DATASET),
]
MaxInputLen = Annotated[
    int | None,
    typer.Option(help="Drop dataset records with more prompt tokens.", rich_help_panel=_DATASET),
]
Temperature = Annotated[
    float | None,
    typer.Option(help="Sampling temperature sent with every request.", rich_help_panel=_DATASET),
]
TopP = Annotated[
    float | None,
    typer.Option(help="Nucleus sampling top_p sent with every request.", rich_help_panel=_DATASET),
]
ExtraBody = Annotated[
    str | None,
    typer.Option(
        help="JSON object merged into every request, e.g. '{\"seed\": 1}'.",
        rich_help_panel=_DATASET,
    ),
]
Warmup = Annotated[
    str | None,
    typer.Option(
        help="Exclude from the measured window: 10s, 20 (requests) or 5%.",
        rich_help_panel=opt.LENGTH,
    ),
]
Cooldown = Annotated[
    str | None,
    typer.Option(help="Exclude the end: 10s, 20 (requests) or 5%.", rich_help_panel=opt.LENGTH),
]
Sweep = Annotated[
    str | None,
    typer.Option(
        help="Stages: rate=0.5,1,2 or concurrency=1,4,16.", rich_help_panel=opt.SLO_SEARCH
    ),
]
FindMaxRate = Annotated[
    bool,
    typer.Option(
        help="Search the highest rate whose goodput fraction stays >= --goodput-target.",
        rich_help_panel=opt.SLO_SEARCH,
    ),
]
GoodputTarget = Annotated[
    float,
    typer.Option(help="Fraction of requests that must meet SLOs.", rich_help_panel=opt.SLO_SEARCH),
]
SearchSteps = Annotated[
    int,
    typer.Option(
        help="Bisection stages after bracketing the max rate.", rich_help_panel=opt.SLO_SEARCH
    ),
]
Matrix = Annotated[
    str | None,
    typer.Option(
        help="Run a matrix of configurations from a file.", rich_help_panel=opt.SLO_SEARCH
    ),
]
Out = Annotated[
    str | None,
    typer.Option(
        help="Run directory (default: runs/<time>-<workload>).", rich_help_panel=opt.OUTPUT
    ),
]
Overwrite = Annotated[
    bool, typer.Option(help="Replace a run already in --out.", rich_help_panel=opt.OUTPUT)
]
Quiet = Annotated[bool, typer.Option(help="No live progress display.", rich_help_panel=opt.OUTPUT)]
Workers = Annotated[
    int,
    typer.Option(
        help="Client worker processes sharing one schedule (for loads one process cannot "
        "drive); with --ray-address, Ray actors.",
        rich_help_panel=opt.LOAD,
    ),
]
RayAddress = Annotated[
    str | None,
    typer.Option(
        help="Run the workers as Ray actors spread over this cluster: auto, HOST:PORT or "
        "ray://HOST:PORT (pip install 'servelab[ray]').",
        rich_help_panel=opt.LOAD,
    ),
]
ScrapeInterval = Annotated[
    str,
    typer.Option(
        help="How often the server's /metrics is scraped during the run (a time series of "
        "its queue, running count and KV usage).",
        rich_help_panel=opt.OUTPUT,
    ),
]
SliceDuration = Annotated[
    str,
    typer.Option(
        help="Length of the time windows (timeslices) with their own percentiles, rates and "
        "queue depth; their trend says whether the run reached a steady state.",
        rich_help_panel=opt.OUTPUT,
    ),
]


def bench(
    ctx: typer.Context,
    url: Url = None,
    model: Model = None,
    tokenizer: Tokenizer = None,
    api_key: ApiKey = None,
    endpoint: opt.Endpoint = "completions",
    engine_args: EngineArgs = "",
    server_config: ServerConfig = None,
    strict_openai: StrictOpenai = False,
    no_request_id_header: NoRequestIdHeader = False,
    cold_connections: ColdConnections = False,
    timeout: Timeout = "600",
    workload: opt.Workload = None,
    trace: opt.Trace = None,
    time_scale: opt.TimeScale = 1.0,
    length_scale: opt.LengthScale = 1.0,
    seed: opt.Seed = 0,
    dataset: Dataset = None,
    dataset_format: DatasetFormat = None,
    dataset_field: DatasetField = None,
    conversation: Conversation = "single-turn",
    history: History = "recorded",
    output_len: OutputLen = "dataset",
    min_input_len: MinInputLen = None,
    max_input_len: MaxInputLen = None,
    temperature: Temperature = None,
    top_p: TopP = None,
    extra_body: ExtraBody = None,
    concurrency: opt.Concurrency = None,
    rate: opt.Rate = None,
    burstiness: opt.Burstiness = 1.0,
    arrival: opt.Arrival = "poisson",
    on_off: opt.OnOff = None,
    ramp_to: opt.RampTo = None,
    ramp_over: opt.RampOver = None,
    requests: opt.Requests = None,
    duration: opt.Duration = None,
    warmup: Warmup = None,
    cooldown: Cooldown = None,
    slo: opt.Slo = None,
    sweep: Sweep = None,
    find_max_rate: FindMaxRate = False,
    goodput_target: GoodputTarget = 0.9,
    search_steps: SearchSteps = 3,
    matrix: Matrix = None,
    out: Out = None,
    overwrite: Overwrite = False,
    quiet: Quiet = False,
    workers: Workers = 1,
    ray_address: RayAddress = None,
    scrape_interval: ScrapeInterval = "0.5s",
    slice_duration: SliceDuration = "10s",
) -> None:
    """Benchmark an OpenAI-compatible endpoint with a workload-shaped load."""
    from servelab.bench.run import run_bench

    if ctx.params["url"] is None:  # the embedded engine serves the run
        require_engine("bench")
    try:
        opts = bench_options(ctx.params)
    except ValueError as e:
        raise fail(str(e), "bench") from None
    if matrix is not None:
        from servelab.workflows.matrix import run_matrix

        raise typer.Exit(run_matrix(Path(matrix), opts))
    try:
        code = run_bench(opts)
    except (ValueError, RuntimeError) as e:
        raise fail(str(e), "bench") from None
    raise typer.Exit(code)


def bench_options(flags: Mapping[str, Any]) -> BenchOptions:
    """The run that `servelab bench`'s parsed ``flags`` ask for, validated.

    Raises typer's BadParameter for a flag it cannot read, ValueError for options that
    do not go together.
    """
    from servelab.bench.manifest import redact
    from servelab.bench.run import BenchOptions
    from servelab.units import SLO, Trim

    sweep = parse_sweep(flags["sweep"]) if flags["sweep"] else None
    opts = BenchOptions(
        url=flags["url"],
        model=flags["model"],
        tokenizer=flags["tokenizer"],
        api_key=flags["api_key"] or None,
        workload=flags["workload"],
        load=opt.load_spec(flags, sweep, search=flags["find_max_rate"]),
        slo=SLO.parse(flags["slo"]) if flags["slo"] else None,
        sweep=sweep,
        find_max_rate=flags["find_max_rate"],
        goodput_target=flags["goodput_target"],
        search_steps=flags["search_steps"],
        out=Path(flags["out"]) if flags["out"] else None,
        engine_args=flags["engine_args"],
        server_config=flags["server_config"],
        seed=flags["seed"],
        endpoint=flags["endpoint"],
        warmup=Trim.parse(flags["warmup"]),
        cooldown=Trim.parse(flags["cooldown"]),
        quiet=flags["quiet"],
        strict_openai=flags["strict_openai"],
        request_id_header=not flags["no_request_id_header"],
        cold_connections=flags["cold_connections"],
        timeout=seconds("--timeout", flags["timeout"]) or 600.0,
        command=redact(["servelab", *sys.argv[1:]]),
        overwrite=flags["overwrite"],
        workers=flags["workers"],
        ray_address=flags["ray_address"],
        dataset=_dataset(flags),
        sampling=_sampling(flags),
        scrape_interval=seconds("--scrape-interval", flags["scrape_interval"]) or 0.0,
        slice_duration=seconds("--slice-duration", flags["slice_duration"]) or 0.0,
    )
    opts.validate()
    return opts


def _dataset(flags: Mapping[str, Any]) -> DatasetSource | None:
    if flags["conversation"] not in ("single-turn", "multi-turn"):
        raise bad_flag(
            "--conversation", f"{flags['conversation']!r}: use single-turn or multi-turn"
        )
    if flags["history"] not in ("recorded", "generated"):
        raise bad_flag("--history", f"{flags['history']!r}: use recorded or generated")
    if flags["dataset"] is None:
        if any(
            flags[k] for k in ("dataset_format", "dataset_field", "min_input_len", "max_input_len")
        ):
            raise bad_flag("--dataset", "the --dataset-*/--*-input-len flags need --dataset SRC")
        return None
    from servelab.bench.workloads.spec import DatasetSource

    try:
        return DatasetSource(
            dataset=flags["dataset"],
            format=flags["dataset_format"],
            field=flags["dataset_field"],
            conversation=flags["conversation"],
            history=flags["history"],
            output_len=parse_output_len(flags["output_len"]),
            min_input_len=flags["min_input_len"],
            max_input_len=flags["max_input_len"],
        )
    except ValueError as e:  # pydantic's ValidationError is one
        raise fail(f"invalid dataset flags: {e}", "bench") from None


def _sampling(flags: Mapping[str, Any]) -> dict[str, object]:
    """``--extra-body`` with ``--temperature`` and ``--top-p`` over it."""
    temperature, top_p = flags["temperature"], flags["top_p"]
    if temperature is not None and temperature < 0:
        raise bad_flag("--temperature", f"{temperature}: give a number >= 0")
    if top_p is not None and not 0 < top_p <= 1:
        raise bad_flag("--top-p", f"{top_p}: give a number in (0, 1]")
    sampling = parse_extra_body(flags["extra_body"])
    if temperature is not None:
        sampling["temperature"] = temperature
    if top_p is not None:
        sampling["top_p"] = top_p
    return sampling


COMMANDS = {"bench": bench}
