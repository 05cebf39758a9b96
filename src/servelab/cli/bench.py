"""`servelab bench`: the workload-shaped benchmark. No heavy imports at module level.

Parse -> spec -> call: its options are ``BenchFlags``' fields (the workload and load ones,
``LoadFlags``, shared with `servelab sim`), ``cli.bench_spec.bench_options`` turns them into
a ``BenchOptions`` and ``run_bench`` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import typer

from servelab.cli.errors import fail
from servelab.cli.extras import require_engine
from servelab.cli.field_options import command_from_fields, flag
from servelab.cli.load_options import (
    LENGTH,
    LOAD,
    OUTPUT,
    SLO_SEARCH,
    TARGET,
    WORKLOAD,
    LoadFlags,
)

DATASET = "Dataset and sampling"


@dataclass(frozen=True)
class BenchFlags:
    """`servelab bench`'s flags, in the order its help lists them within each panel."""

    url: str | None = flag(
        None,
        "Base URL of an OpenAI-compatible server. Default: start `servelab serve`.",
        panel=TARGET,
    )
    model: str | None = flag(
        None,
        "Model to serve (embedded) or to name in requests (default: the server's first).",
        panel=TARGET,
    )
    tokenizer: str | None = flag(
        None,
        "Tokenizer for exact prompt lengths: a model name, HF dir or .gguf, or 'server' "
        "(the server's POST /tokenize). Default: --model's where servelab can read it, else "
        "the server's /tokenize (vLLM, SGLang, llama.cpp), else the default model's.",
        panel=TARGET,
    )
    api_key: str | None = flag(
        None,
        "Bearer token; never written to the run directory.",
        panel=TARGET,
        envvar=["OPENAI_API_KEY", "SERVELAB_API_KEY"],
        show_default=False,
        show_envvar=True,
    )
    load: LoadFlags = field(default_factory=LoadFlags)
    engine_args: str = flag(
        "", 'Flags for the embedded `servelab serve`, e.g. "--max-num-seqs 8".', panel=TARGET
    )
    server_config: str | None = flag(
        None,
        "Another server's launch command or flags, e.g. 'vllm serve M "
        "--no-enable-chunked-prefill': recorded (secrets redacted) so diagnosis and "
        "calibrate know its settings.",
        panel=TARGET,
    )
    strict_openai: bool = flag(
        False,
        "Send only OpenAI's own fields (no min_tokens/ignore_eos): output lengths "
        "are then not forced.",
        panel=TARGET,
    )
    no_request_id_header: bool = flag(
        False,
        "Send no X-Request-Id (by default each request carries a UUID the server's own "
        "logs can be joined by; a server that refuses it is detected and reported anyway).",
        panel=TARGET,
        decls=("--no-request-id-header",),
    )
    cold_connections: bool = flag(
        False,
        "Open each stream's connection inside the measured window, its set-up counted in "
        "TTFT (by default they are opened before the clock starts, and the set-up recorded apart).",
        panel=TARGET,
        decls=("--cold-connections",),
    )
    timeout: str = flag("600", "Per-request timeout (seconds, or 10min).", panel=TARGET)
    dataset: str | None = flag(
        None,
        "Real prompts instead of synthetic text: a file (sharegpt JSON, openai-chat or "
        "openai-batch JSONL, jsonl, csv, parquet) or 'sharegpt' (the offline copy).",
        panel=DATASET,
    )
    dataset_format: str | None = flag(None, "Override the detected dataset format.", panel=DATASET)
    dataset_field: str | None = flag(
        None, "jsonl/csv/parquet: the prompt column (default: prompt).", panel=DATASET
    )
    conversation: str = flag(
        "single-turn",
        "single-turn (the first user turn) or multi-turn (each conversation as a session).",
        panel=DATASET,
    )
    history: str = flag(
        "recorded",
        "multi-turn: send the recorded replies as history, or the model's own (generated).",
        panel=DATASET,
    )
    output_len: str = flag(
        "dataset",
        "dataset (the recorded reply's length, forced), natural (not forced) or N tokens.",
        panel=DATASET,
    )
    min_input_len: int | None = flag(
        None, "Drop dataset records with fewer prompt tokens.", panel=DATASET
    )
    max_input_len: int | None = flag(
        None, "Drop dataset records with more prompt tokens.", panel=DATASET
    )
    temperature: float | None = flag(
        None, "Sampling temperature sent with every request.", panel=DATASET
    )
    top_p: float | None = flag(
        None, "Nucleus sampling top_p sent with every request.", panel=DATASET
    )
    extra_body: str | None = flag(
        None, "JSON object merged into every request, e.g. '{\"seed\": 1}'.", panel=DATASET
    )
    warmup: str | None = flag(
        None, "Exclude from the measured window: 10s, 20 (requests) or 5%.", panel=LENGTH
    )
    cooldown: str | None = flag(None, "Exclude the end: 10s, 20 (requests) or 5%.", panel=LENGTH)
    sweep: str | None = flag(None, "Stages: rate=0.5,1,2 or concurrency=1,4,16.", panel=SLO_SEARCH)
    find_max_rate: bool = flag(
        False,
        "Search the highest rate whose goodput fraction stays >= --goodput-target.",
        panel=SLO_SEARCH,
    )
    goodput_target: float = flag(0.9, "Fraction of requests that must meet SLOs.", panel=SLO_SEARCH)
    search_steps: int = flag(3, "Bisection stages after bracketing the max rate.", panel=SLO_SEARCH)
    matrix: str | None = flag(None, "Run a matrix of configurations from a file.", panel=SLO_SEARCH)
    out: str | None = flag(None, "Run directory (default: runs/<time>-<workload>).", panel=OUTPUT)
    overwrite: bool = flag(False, "Replace a run already in --out.", panel=OUTPUT)
    quiet: bool = flag(False, "No live progress display.", panel=OUTPUT)
    workers: int = flag(
        1,
        "Client worker processes sharing one schedule (for loads one process cannot "
        "drive); with --ray-address, Ray actors.",
        panel=LOAD,
    )
    ray_address: str | None = flag(
        None,
        "Run the workers as Ray actors spread over this cluster: auto, HOST:PORT or "
        "ray://HOST:PORT (pip install 'servelab[ray]').",
        panel=LOAD,
    )
    scrape_interval: str = flag(
        "0.5s",
        "How often the server's /metrics is scraped during the run (a time series of "
        "its queue, running count and KV usage).",
        panel=OUTPUT,
    )
    slice_duration: str = flag(
        "10s",
        "Length of the time windows (timeslices) with their own percentiles, rates and "
        "queue depth; their trend says whether the run reached a steady state.",
        panel=OUTPUT,
    )


def bench(flags: BenchFlags) -> None:
    """Benchmark an OpenAI-compatible endpoint with a workload-shaped load."""
    from servelab.bench.run import run_bench
    from servelab.cli.bench_spec import bench_options

    if flags.url is None:  # the embedded engine serves the run
        require_engine("bench")
    try:
        opts = bench_options(flags)
    except ValueError as e:
        raise fail(str(e), "bench") from None
    if flags.matrix is not None:
        from servelab.workflows.matrix import run_matrix

        raise typer.Exit(run_matrix(Path(flags.matrix), opts))
    try:
        code = run_bench(opts)
    except (ValueError, RuntimeError) as e:
        raise fail(str(e), "bench") from None
    raise typer.Exit(code)


PANELS = (TARGET, WORKLOAD, DATASET, LOAD, LENGTH, SLO_SEARCH, OUTPUT)
COMMANDS = {"bench": command_from_fields(BenchFlags, bench, PANELS)}
