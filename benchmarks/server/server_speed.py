"""How fast is `servelab serve` over HTTP, and what does the serving layer itself cost?

One run, against one server started here (or ``--url`` for a running one):

1. batch 1: ``--batch1-requests`` requests one after another, ``--input-len`` tokens in,
   ``--output-len`` out -> TTFT and TPOT (medians);
2. concurrency ``--concurrency``: that many clients, each sending ``--rounds`` requests
   back to back -> output tokens/s over the window, TTFT p50, ITL p99;
3. the serving layer under that load, from the server's /metrics: API event-loop lag,
   HTTP arrival -> add_request in the engine core, core -> API output latency, and the
   engine core's busy/idle split.

Prompts are random token ids (exactly ``--input-len`` tokens, no shared prefix) and
``ignore_eos`` fixes every output at ``--output-len`` tokens. The client is one asyncio
process streaming with aiohttp; TTFT is send -> first token-bearing chunk, TPOT
(e2e - ttft) / (tokens - 1), ITL the gaps between token-bearing chunks (vLLM's definitions,
as in servelab.vocab).

Pinning: on a machine with at least 2 CPUs the server (both of its processes) runs on the
last CPU and this client on the first (``taskset``), so the client's parsing never steals
the engine's core; ``--no-pin`` turns that off. With pinning the engine core gets 1 torch
thread, the configuration of vLLM's CPU reference figures in docs/reference-figures.md (~100 ms TPOT at
batch 1, ~32 output tok/s at concurrency 16 for 256 in / 64 out on SmolLM2-135M).

Figures are provisional whenever other work shares the machine: compare within one run.

Usage: python -m benchmarks.server.server_speed [--model smollm2-135m] [--quick] [--url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass, field

import aiohttp
import httpx
import msgspec

from benchmarks.common import random_prompt, serve
from servelab.bench.servers.target import free_port
from servelab.modelcore.tokenizer import Tokenizer
from servelab.vocab import ClientRecord

VLLM_TPOT_MS = 101.0  # docs/reference-figures.md: vLLM 0.32 CPU, 1 thread, concurrency 1
VLLM_TOK_S_C16 = 32.0  # docs/reference-figures.md: vLLM 0.32 CPU, 1 thread, concurrency 16


@dataclass
class Result:
    records: list[ClientRecord] = field(default_factory=list)
    wall: float = 0.0

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.records)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def start_server(
    args: argparse.Namespace, server_cpu: int | None
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    flags = ["--model", args.model, "--max-model-len", str(args.input_len + args.output_len + 16)]
    flags += ["--log-level", "warning"]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    return serve(flags, port, server_cpu, quiet=not args.verbose), f"http://127.0.0.1:{port}"


async def one_request(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], output_len: int
) -> ClientRecord:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    now = time.monotonic()
    rec = ClientRecord(
        request_id="",
        workload_class="server_speed",
        intended_send=now,
        actual_send=now,
        input_tokens=len(prompt),
        requested_output_tokens=output_len,
    )
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        rec.status = resp.status
        rec.first_byte = time.monotonic()
        rec.request_id = resp.headers.get("X-Request-Id", "")
        if resp.status != 200:
            rec.error = (await resp.text())[:200]
            return rec
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            t = time.monotonic()
            event = msgspec.json.decode(line[6:])
            if event.get("choices"):
                rec.chunk_times.append(t)
                rec.chunk_tokens.append(1)
            if event.get("usage"):
                rec.output_tokens = event["usage"]["completion_tokens"]
    rec.done = time.monotonic()
    return rec


async def run_phase(
    url: str,
    model: str,
    tok: Tokenizer,
    concurrency: int,
    per_client: int,
    input_len: int,
    output_len: int,
    seed: int,
) -> Result:
    rng = random.Random(seed)
    result = Result()

    async def client(session: aiohttp.ClientSession) -> None:
        for _ in range(per_client):
            # Ids 0..9 hold the special tokens of SmolLM2-like vocabularies.
            prompt = random_prompt(rng, input_len, tok.vocab_size, first=10)
            result.records.append(await one_request(session, url, model, prompt, output_len))

    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        t0 = time.monotonic()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        result.wall = time.monotonic() - t0
    errors = [r.error for r in result.records if r.error]
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, e.g. {errors[0]}")
    return result


def scrape(url: str) -> dict[str, float]:
    """Every non-bucket sample of /metrics, summed over label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in fam.samples:
            if not s.name.endswith("_bucket"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def serving_overhead(before: dict[str, float], after: dict[str, float]) -> list[tuple[str, str]]:
    def mean_ms(name: str) -> str:
        n = after.get(f"{name}_count", 0) - before.get(f"{name}_count", 0)
        total = after.get(f"{name}_sum", 0) - before.get(f"{name}_sum", 0)
        return f"{1000 * total / n:.2f} ms (n={int(n)})" if n else "n/a"

    busy = (
        after["servelab:engine_core_busy_seconds_total"]
        - before["servelab:engine_core_busy_seconds_total"]
    )
    idle = (
        after["servelab:engine_core_idle_seconds_total"]
        - before["servelab:engine_core_idle_seconds_total"]
    )
    return [
        ("API event-loop lag (mean, 50 ms timer)", mean_ms("servelab:api_event_loop_lag_seconds")),
        ("HTTP arrival -> add_request in core (mean)", mean_ms("servelab:api_to_core_seconds")),
        ("core -> API step outputs (mean)", mean_ms("servelab:core_to_api_seconds")),
        ("engine step (mean)", mean_ms("servelab:step_duration_seconds")),
        (
            "engine core busy / (busy + idle)",
            f"{busy / (busy + idle):.1%}" if busy + idle else "n/a",
        ),
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--url", help="benchmark a running server instead of starting one")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch1-requests", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="requests per client at concurrency")
    p.add_argument("--threads", type=int, help="engine-core torch threads (default: the server's)")
    p.add_argument(
        "--no-pin", action="store_true", help="do not pin server and client with taskset"
    )
    p.add_argument("--quick", action="store_true", help="small sizes, to check the script runs")
    p.add_argument("--verbose", action="store_true", help="show the server's log")
    args = p.parse_args(argv)
    if args.quick:
        args.input_len, args.output_len, args.batch1_requests = 32, 8, 2
        args.concurrency, args.rounds = 4, 1
    return args


@dataclass(kw_only=True)
class Phases:
    """The batch-1 and the concurrent phase, and /metrics around the concurrent one."""

    batch1: Result
    concurrent: Result
    before: dict[str, float]
    after: dict[str, float]


def run(args: argparse.Namespace) -> Phases:
    cpus = sorted(os.sched_getaffinity(0))
    pin = not args.no_pin and args.url is None and len(cpus) >= 2 and shutil.which("taskset")
    proc = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        proc, url = start_server(args, cpus[-1] if pin else None)
    if pin:
        os.sched_setaffinity(0, {cpus[0]})
        print(f"pinned: server on CPU {cpus[-1]}, client on CPU {cpus[0]}")
    try:
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        tok = Tokenizer.from_model(args.model)
        # Warm the path once (first-request costs are not the figure).
        asyncio.run(run_phase(url, model, tok, 1, 1, args.input_len, 4, seed=0))
        b1 = asyncio.run(
            run_phase(
                url, model, tok, 1, args.batch1_requests, args.input_len, args.output_len, seed=1
            )
        )
        before = scrape(url)
        cc = asyncio.run(
            run_phase(
                url,
                model,
                tok,
                args.concurrency,
                args.rounds,
                args.input_len,
                args.output_len,
                seed=2,
            )
        )
        after = scrape(url)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    return Phases(batch1=b1, concurrent=cc, before=before, after=after)


def show(args: argparse.Namespace, ph: Phases) -> None:
    b1, cc = ph.batch1, ph.concurrent
    ttft1 = statistics.median(r.ttft for r in b1.records if r.ttft is not None)
    tpot1 = statistics.median(r.tpot for r in b1.records if r.tpot is not None)
    tok_s = cc.output_tokens / cc.wall
    ttfts = [r.ttft for r in cc.records if r.ttft is not None]
    itls = [g for r in cc.records for g in r.itls]
    print(
        f"\nservelab serve, {args.model}: {args.input_len} in / {args.output_len} out "
        f"(provisional: the machine may be shared)"
    )
    print(
        f"  batch 1      TTFT {1000 * ttft1:8.1f} ms   TPOT {1000 * tpot1:7.1f} ms"
        f"   (vLLM CPU ref TPOT {VLLM_TPOT_MS:.0f} ms: ratio {1000 * tpot1 / VLLM_TPOT_MS:.2f})"
    )
    print(
        f"  conc. {args.concurrency:<5}  {tok_s:6.1f} output tok/s   TTFT p50 {1000 * _percentile(ttfts, 50):8.1f} ms"
        f"   ITL p99 {1000 * _percentile(itls, 99):7.1f} ms"
        f"   (vLLM CPU ref {VLLM_TOK_S_C16:.0f} tok/s: ratio {tok_s / VLLM_TOK_S_C16:.2f})"
    )
    print("  serving layer during the concurrent phase:")
    for name, value in serving_overhead(ph.before, ph.after):
        print(f"    {name:<45} {value}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    show(args, run(args))


if __name__ == "__main__":
    main()
