"""`servelab serve`: the OpenAI-compatible server. No heavy imports at module level."""

from __future__ import annotations

import typer

from servelab.cli.errors import fail
from servelab.server.args import API_KEY_ENV, DEFAULT_MODEL, ServerArgs


def serve(
    model: str = typer.Option(DEFAULT_MODEL, help="Model short name, HF directory or .gguf file."),
    host: str = typer.Option("127.0.0.1", help="Address to bind (loopback by default)."),
    port: int = typer.Option(8000, help="Port to bind; 0 picks a free one."),
    api_key: str | None = typer.Option(
        None,
        envvar=API_KEY_ENV,
        show_default=False,
        help=f"Require 'Authorization: Bearer KEY' on /v1 routes and POST /reset_prefix_cache "
        f"(or set ${API_KEY_ENV}); /health, /metrics and /version stay open.",
    ),
    served_model_name: str | None = typer.Option(
        None, help="Name clients pass as 'model' (default: --model)."
    ),
    max_num_batched_tokens: int | None = typer.Option(
        None, help="Token budget of one engine step."
    ),
    max_num_seqs: int | None = typer.Option(None, help="Most sequences in one engine step."),
    max_model_len: int | None = typer.Option(None, help="Context length (default: the model's)."),
    enable_chunked_prefill: bool = typer.Option(
        True, "--enable-chunked-prefill/--no-enable-chunked-prefill", help="Split long prefills."
    ),
    enable_prefix_caching: bool = typer.Option(
        True,
        "--enable-prefix-caching/--no-enable-prefix-caching",
        help="Reuse cached prompt blocks.",
    ),
    num_gpu_blocks_override: int | None = typer.Option(
        None, help="KV cache size in blocks (overrides --kv-cache-memory)."
    ),
    kv_cache_memory: str | None = typer.Option(
        None, help="KV cache size, e.g. 2G or 512MiB (a bare number is GB; default 2)."
    ),
    block_size: int | None = typer.Option(None, help="Tokens per KV block."),
    max_queue: int | None = typer.Option(
        None, help="Waiting requests beyond which new ones get 429 with Retry-After."
    ),
    device: str | None = typer.Option(
        None, help="cpu, cuda or cuda:N (default: cuda if present, else cpu)."
    ),
    threads: int | None = typer.Option(
        None,
        help="Torch threads of the engine core (default: usable CPUs - 1, at least 1); "
        "with --disaggregated, of each worker (default: see docs/disaggregation.md).",
    ),
    quantization: str = typer.Option(
        "none",
        help="Weights: none (fp32) or q4_1 (the GGUF's own Q4_1 blocks, kept quantised and "
        "run on servelab's AVX2 CPU kernels).",
    ),
    shutdown_timeout: float = typer.Option(
        30.0, help="On SIGTERM, seconds to let in-flight requests finish before aborting them."
    ),
    max_stop_sequences: int = typer.Option(
        4, help="Most stop strings one request may send (OpenAI's limit is 4)."
    ),
    max_body_size: str = typer.Option(
        "16MiB", help="Largest request body, e.g. 16MiB or 64M; bigger ones get 413."
    ),
    header_timeout: float = typer.Option(
        5.0,
        help="Seconds a connection may take to send a request's headers, from its opening or "
        "from their first byte; a slower one is closed.",
    ),
    keep_alive_timeout: float = typer.Option(
        30.0,
        help="Seconds an idle keep-alive connection stays open (longer than clients' pools "
        "keep one, so that the client closes it first).",
    ),
    body_timeout: float = typer.Option(
        30.0,
        help="Seconds a request's body may take to arrive after its headers; a slower one "
        "gets 408 and the connection is closed.",
    ),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
    simulate: str | None = typer.Option(
        None,
        help="Serve the real API with simulated timings, e.g. h200:llama-3.1-8b "
        "(see servelab sim --help).",
    ),
    speculative_config: str | None = typer.Option(
        None,
        help='Speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": '
        "4}'; methods: ngram (prompt_lookup_min/max), draft (model), self-draft (num_layers).",
    ),
    disaggregated: bool = typer.Option(
        False,
        "--disaggregated",
        help="Prefill and decode in separate worker processes with their own KV pools.",
    ),
    prefill_workers: int = typer.Option(1, help="With --disaggregated: prefill workers."),
    decode_workers: int = typer.Option(1, help="With --disaggregated: decode workers."),
    kv_transport: str = typer.Option(
        "shm", help="With --disaggregated: KV transfer by shm (one host) or socket (TCP)."
    ),
    kv_host: str = typer.Option(
        "127.0.0.1", help="With --kv-transport socket: address decode workers listen on."
    ),
    kv_transfer_timeout: float = typer.Option(
        30.0, help="With --disaggregated: seconds a KV reservation + transfer may take."
    ),
    kv_handoff_timeout: float = typer.Option(
        600.0, help="With --disaggregated: seconds a request may wait for decode KV room."
    ),
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (completions, chat, metrics)."""
    args = ServerArgs(
        model=model,
        host=host,
        port=port,
        api_key=api_key or None,  # an empty $SERVELAB_API_KEY means no key
        served_model_name=served_model_name,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        enable_prefix_caching=enable_prefix_caching,
        num_gpu_blocks_override=num_gpu_blocks_override,
        kv_cache_memory=kv_cache_memory,
        block_size=block_size,
        max_queue=max_queue,
        device=device,
        threads=threads,
        quantization=quantization,
        shutdown_timeout=shutdown_timeout,
        max_stop_sequences=max_stop_sequences,
        max_body_size=max_body_size,
        header_timeout=header_timeout,
        keep_alive_timeout=keep_alive_timeout,
        body_timeout=body_timeout,
        log_level=log_level,
        simulate=simulate,
        speculative_config=speculative_config,
        disaggregated=disaggregated,
        prefill_workers=prefill_workers,
        decode_workers=decode_workers,
        kv_transport=kv_transport,
        kv_host=kv_host,
        kv_transfer_timeout=kv_transfer_timeout,
        kv_handoff_timeout=kv_handoff_timeout,
    )
    from servelab.model.registry import resolve_model

    try:
        args.validate()
        resolve_model(args.model)  # an unknown model fails now, not after a process start
        draft = args.engine_config().speculative()
        if draft is not None and draft.model is not None:
            resolve_model(draft.model)
    except ValueError as e:
        raise fail(str(e), "serve") from None

    from servelab.server.main import run_server

    raise typer.Exit(run_server(args))


def register(app: typer.Typer) -> None:
    """Add `servelab serve` to the `servelab` app."""
    app.command("serve")(serve)
