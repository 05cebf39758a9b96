"""Start-up and shutdown of `servelab serve` (the API process).

Order: start the engine core (model load, KV pool, warm-up) while loading the tokenizer
here, then bind HTTP and log ``servelab serve: ready on http://HOST:PORT``. On SIGTERM
or SIGINT: answer 503 to new requests, stop listening, let in-flight requests finish for
``--shutdown-timeout`` seconds, end the rest with finish_reason "abort", stop the core,
and return 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Callable

from aiohttp import web

from servelab.server import ipc
from servelab.server.api import ApiAppRunner, ServerState, build_app
from servelab.server.bounds import longest_token_chars
from servelab.server.engine_client import CoreStartupError, EngineClient
from servelab.server.metrics import ServerMetrics
from servelab.server.openai_protocol import ModelLimits
from servelab.server.prepare import PreparePool, load_tokenizer
from servelab.server.server_args import ServerArgs
from servelab.server.serving_client import ServingClient
from servelab.server.timelines import TimelineStore

log = logging.getLogger("servelab.server")

_DRAIN_POLL_S = 0.05
LINGER_S = 2.0  # aiohttp's lingering read of an unread body (see the runner below)


def _bound_port(runner: web.AppRunner, fallback: int) -> int:
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            return int(addr[1])
    return fallback


def _make_client(
    args: ServerArgs, metrics: ServerMetrics, engine_factory: str | None
) -> ServingClient:
    """One engine core (EngineClient), or the disaggregated router over its workers: both
    are ``ServingClient``s."""
    if args.disaggregated:
        from servelab.server.disagg.router import DisaggClient

        log.info(
            "servelab serve: starting %d prefill + %d decode workers for %s (KV transport: %s)",
            args.prefill_workers,
            args.decode_workers,
            args.model,
            args.kv_transport,
        )
        # The workers' default engine is the disaggregated one; a test factory replaces it.
        return DisaggClient(args, metrics, TimelineStore(), engine_factory=engine_factory)
    core_cfg = ipc.CoreConfig(
        model=args.model,
        engine=dataclasses.asdict(args.engine_config()),
        inputs_addr="",
        outputs_addr="",
        device=args.device,
        torch_threads=args.torch_threads,
        quantization=args.quantization,
        log_level=args.log_level,
    )
    if args.simulate is not None:
        core_cfg.simulate = args.simulate
        core_cfg.engine_factory = "servelab.sim.realtime:build_engine"
    if engine_factory is not None:
        core_cfg.engine_factory = engine_factory
    log.info(
        "servelab serve: starting the engine core for %s (%d torch threads; this process keeps "
        "one thread for HTTP)",
        args.model,
        args.torch_threads,
    )
    return EngineClient(core_cfg, metrics, TimelineStore())


async def serve(
    args: ServerArgs,
    *,
    engine_factory: str | None = None,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[int], None] | None = None,
) -> int:
    """Run the server until ``stop`` is set (or SIGTERM/SIGINT in the main thread).

    ``engine_factory`` replaces the real engine (tests use it to exercise the processes and
    IPC without weights). ``on_ready`` gets the bound port. Returns the exit status.
    """
    stop = stop or asyncio.Event()
    metrics = ServerMetrics(args.model_name)
    client = _make_client(args, metrics, engine_factory)
    t0 = time.monotonic()
    tok_task = asyncio.create_task(asyncio.to_thread(load_tokenizer, args.model))
    prepare_pool = PreparePool(args.model)
    pool_task = asyncio.create_task(prepare_pool.start())
    try:
        info = await client.start()
        tokenizer = await tok_task
        await pool_task
    except (CoreStartupError, ValueError, OSError) as e:
        log.error("servelab serve: could not start: %s", e)
        tok_task.cancel()
        pool_task.cancel()
        prepare_pool.shutdown()
        await client.shutdown()
        return 1
    log.info(
        "servelab serve: engine ready in %.1f s (KV pool: %d blocks of %d tokens; max_model_len %d)",
        time.monotonic() - t0,
        info.num_kv_blocks,
        info.block_size,
        info.max_model_len,
    )
    names = tuple(dict.fromkeys((args.model_name, args.model)))
    limits = ModelLimits(
        names=names,
        max_model_len=info.max_model_len,
        vocab_size=tokenizer.vocab_size,
        kv_capacity_tokens=info.num_kv_blocks * info.block_size,
        max_token_chars=longest_token_chars(tokenizer),
        max_stop_sequences=args.max_stop_sequences,
    )
    state = ServerState(
        client,
        tokenizer,
        limits,
        prepare_pool,
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout,
    )
    runner = ApiAppRunner(
        build_app(state),
        handler_cancellation=True,
        access_log=None,
        handle_signals=False,
        shutdown_timeout=max(1.0, args.shutdown_timeout),
        head_timeout=args.header_timeout,
        keepalive_timeout=args.keep_alive_timeout,
        # After answering without reading the whole body (408, 413, 401), aiohttp reads and
        # drops the rest for up to this long, so that the client gets the answer instead of
        # a reset. Its default, 10 s, let a body trickling past --body-timeout hold the
        # connection 10 s more; a client sending at any real speed is done well within 2 s.
        lingering_time=LINGER_S,
    )
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, reuse_address=True)
    try:
        await site.start()
    except OSError as e:
        log.error(
            "servelab serve: cannot listen on %s:%d (%s); pick another --port",
            args.host,
            args.port,
            e,
        )
        await runner.cleanup()
        prepare_pool.shutdown()
        await client.shutdown()
        return 1
    port = _bound_port(runner, args.port)
    log.info("servelab serve: ready on http://%s:%d", args.host, port)
    if on_ready is not None:
        on_ready(port)

    loop = asyncio.get_running_loop()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    state.draining = True
    await site.stop()  # no new connections; open ones get 503 for new requests
    n = client.num_in_flight
    if n:
        log.info(
            "servelab serve: stopping; letting %d in-flight requests finish (up to %.0f s)",
            n,
            args.shutdown_timeout,
        )
    deadline = time.monotonic() + args.shutdown_timeout
    while client.num_in_flight and client.alive and time.monotonic() < deadline:
        await asyncio.sleep(_DRAIN_POLL_S)
    aborted = client.abort_all()
    if aborted:
        log.warning(
            "servelab serve: ended %d unfinished requests with finish_reason 'abort'", aborted
        )
    await runner.cleanup()
    prepare_pool.shutdown()
    await client.shutdown()
    log.info("servelab serve: stopped")
    return 0


def run_server(args: ServerArgs) -> int:
    """Entry point of `servelab serve`: configure logging, run on uvloop, return the exit status."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s", force=True
    )
    try:
        import uvloop
    except ImportError:  # optional on platforms without it
        return asyncio.run(serve(args))
    return uvloop.run(serve(args))
