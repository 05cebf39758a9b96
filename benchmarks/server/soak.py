"""Soak and chaos for `servelab serve`: does an hour of hostile traffic leak anything?

One bounded run, in four acts, against a server started here (the default model):

0. **Door**: each of the heaviest single requests known (``WORST``), alone, while the same
   client polls ``/health`` every 10 ms; the worst poll must stay under 100 ms. Beside it:
   the idle round trip, and how often the server's own event-loop timer was over 100 ms
   late (which tells a stalled API process from a slow client or a busy CPU).
   ``--door-only`` stops after this act.
1. **Load** for ``--minutes`` (default 30): streamed completions with Poisson arrivals at
   ``--rate`` requests/s (default: 80% of the capacity measured first, as requests finished
   in 60 s with 16 always in flight),
   prompts of 16-400 tokens and 16-128 output tokens. ``--hangup`` of them (10%) disconnect
   after a random number of events, and every ``--fuzz-every`` seconds a hostile request is
   sent (huge integers, deep nesting, huge strings and stop lists, many messages, broken
   JSON); each must get a 4xx.
2. **Kill** at ``--kill-at`` of the load (default a quarter, so that the last 20 minutes,
   where RSS slopes are taken, are the restarted server's): the engine core is SIGKILLed.
   Open requests must end (with ``engine_dead``), then the server is stopped and started
   again and the load goes on.
3. **Drain**: SIGTERM with requests in flight; the server must exit 0.

Every 10 s it records the RSS of each server process, KV blocks in use against running
requests, open file descriptors, and the API's event-loop lag (``/health`` round trip and
the server's own ``servelab:api_event_loop_lag_seconds``). At the end it prints the slope of
each process's RSS over the last 20 minutes (or the last two thirds of a shorter run), the 5xx count outside
the kill window, requests that never ended, and KV blocks still held once idle.

Targets: 0 5xx outside the kill, 0 leaked blocks, 0 requests without an end, RSS slope
<= 1 MB/min. Pinning: with 2+ CPUs the server runs on the last CPU and this client on the
first (``taskset``).

Usage: python -m benchmarks.server.soak [--minutes 30] [--rate R] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass, field

import aiohttp
import psutil

from benchmarks.common import serve
from servelab.bench.servers.target import free_port

HOSTILE: list[tuple[str, bytes]] = [
    ("huge int", b'{"prompt": "hi", "max_tokens": 4, "priority": 1208925819614629174706176}'),
    ("deep nesting", b'{"prompt": "hi", "x": ' + b"[" * 2000 + b"]" * 2000 + b"}"),
    ("huge string", json.dumps({"prompt": "word " * 3_000_000, "max_tokens": 4}).encode()),
    ("huge stop list", json.dumps({"prompt": "hi", "stop": ["x"] * 100_000}).encode()),
    (
        "many messages",
        json.dumps({"messages": [{"role": "user", "content": "hi"}] * 100_000}).encode(),
    ),
    ("broken json", b'{"prompt": "hi", "max_tokens": '),
    ("negative max_tokens", b'{"prompt": "hi", "max_tokens": -5}'),
]
# The heaviest single requests known (probed against the server's request preparation): each
# is sent alone while /health is polled; /health must answer within DOOR_TARGET_S.
WORST: list[tuple[str, str, bytes]] = [
    (
        "chat, 300,000 messages (10.5 MB)",
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "hi"}] * 300_000}).encode(),
    ),
    (
        "chat, 2048 messages of 300 characters (templated)",
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "word " * 60}] * 2048}).encode(),
    ),
    (
        "prompt of 15 MB",
        "/v1/completions",
        json.dumps({"prompt": "y" * 15_000_000, "max_tokens": 2}).encode(),
    ),
    (
        "8 million token ids (16 MB)",
        "/v1/completions",
        b'{"prompt": [' + b"1," * 8_000_000 + b"1]}",
    ),
    (
        "5 MB of brackets in a string",
        "/v1/completions",
        json.dumps({"prompt": "hi", "max_tokens": 2, "x": "[" * 5_000_000}).encode(),
    ),
    (
        "an unknown field of 8 million numbers",
        "/v1/completions",
        b'{"prompt": "hi", "max_tokens": 2, "x": [' + b"1," * 8_000_000 + b"1]}",
    ),
    ("valid, 40 KB prompt", "/v1/completions", json.dumps({"prompt": "word " * 8_000}).encode()),
]
DOOR_TARGET_S = 0.100
PROBE_S = 60.0
WORDS = "the paged cache keeps keys and values of every token in fixed blocks".split()


@dataclass
class Tally:
    hangup_fraction: float = 0.0
    sent: int = 0
    ended: int = 0  # a final event, an error status or a deliberate hang-up
    hung_up: int = 0
    status: dict[int, int] = field(default_factory=dict)
    fivexx_outside_kill: int = 0
    cut: int = 0  # streams closed without [DONE] or an error event, outside the kill
    fuzz_not_4xx: list[str] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    # client errors outside the kill: (monotonic time, what was sent, what happened)
    failures: list[tuple[float, str, str]] = field(default_factory=list)


def start_server(cpu: int | None, port: int) -> subprocess.Popen[bytes]:
    return serve(["--log-level", "warning", "--max-model-len", "1024"], port, cpu)


def role(p: psutil.Process, server: subprocess.Popen[bytes]) -> str:
    """api (the server process), core (the engine), prepare (request-preparation workers)
    or mp (multiprocessing's resource tracker)."""
    if p.pid == server.pid:
        return "api"
    cmd = " ".join(p.cmdline())
    if "servelab.server.engine_core" in cmd:
        return "core"
    return "prepare" if "spawn_main" in cmd else "mp"


def core_pid(server: subprocess.Popen[bytes]) -> int:
    kids = psutil.Process(server.pid).children(recursive=True)
    return next(p.pid for p in kids if role(p, server) == "core")


def metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, _, value = line.rpartition(" ")
        out[name.split("{")[0]] = float(value)
    return out


async def one_request(s: aiohttp.ClientSession, url: str, t: Tally, killing: list[bool]) -> None:
    n_in, n_out = random.randint(16, 400), random.randint(16, 128)
    body = {"prompt": " ".join(random.choices(WORDS, k=n_in)), "max_tokens": n_out}
    body |= {"stream": True, "ignore_eos": True}
    hang = random.random() < t.hangup_fraction
    stop_after = random.randint(0, 3)
    t.sent += 1
    events = 0
    try:
        async with s.post(f"{url}/v1/completions", json=body) as r:
            t.status[r.status] = t.status.get(r.status, 0) + 1
            if r.status >= 500 and not killing[0]:
                t.fivexx_outside_kill += 1
            if r.status != 200:
                t.ended += 1
                return
            async for line in r.content:
                if not line.startswith(b"data:"):
                    continue
                events += 1
                if hang and events > stop_after:
                    t.hung_up += 1
                    t.ended += 1
                    return
                if line.strip() == b"data: [DONE]" or b'"error"' in line:
                    t.ended += 1
                    return
        if killing[0]:
            t.ended += 1  # the server went away with the kill
        else:
            t.cut += 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        if killing[0]:
            t.ended += 1
        else:
            t.failures.append((time.monotonic(), f"stream after {events} events", repr(e)))


async def fuzz(s: aiohttp.ClientSession, url: str, t: Tally, killing: list[bool]) -> None:
    name, body = random.choice(HOSTILE)
    try:
        headers = {"Content-Type": "application/json"}
        async with s.post(f"{url}/v1/completions", data=body, headers=headers) as r:
            await r.read()
            if not 400 <= r.status < 500 and not killing[0]:
                t.fuzz_not_4xx.append(f"{name}: {r.status}")
    except aiohttp.ClientError as e:
        if not killing[0]:  # the server is being killed and restarted
            t.fuzz_not_4xx.append(f"{name}: {type(e).__name__}")
            t.failures.append((time.monotonic(), f"fuzz {name}", repr(e)))


async def sample(s: aiohttp.ClientSession, url: str, server: subprocess.Popen[bytes], t0: float):
    t1 = time.monotonic()
    async with s.get(f"{url}/health") as r:
        await r.read()
    health_rtt = time.monotonic() - t1
    async with s.get(f"{url}/metrics") as r:
        m = metrics(await r.text())
    procs = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
    return {
        "t": time.monotonic() - t0,
        "rss_mb": {f"{role(p, server)}:{p.pid}": p.memory_info().rss / 2**20 for p in procs},
        "fds": sum(p.num_fds() for p in procs),
        "kv_blocks_used": m.get("servelab:kv_cache_blocks_used"),
        "running": m.get("vllm:num_requests_running"),
        "health_rtt_s": health_rtt,
        "loop_lag_sum_s": m.get("servelab:api_event_loop_lag_seconds_sum"),
    }


async def load(url: str, rate: float, seconds: float, t: Tally, args, on_half=None) -> None:
    killing = [False]
    t0 = time.monotonic()
    tasks: set[asyncio.Task] = set()
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        next_fuzz = t0 + args.fuzz_every
        next_sample = t0
        kill_at = t0 + seconds * args.kill_at if on_half else float("inf")
        while time.monotonic() - t0 < seconds:
            now = time.monotonic()
            if now >= kill_at:
                killing[0] = True
                await on_half()
                await asyncio.gather(*tasks, return_exceptions=True)  # every one must end
                killing[0] = False
                kill_at = float("inf")
                continue
            task = asyncio.create_task(one_request(s, url, t, killing))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            if now >= next_fuzz:
                fuzzing = asyncio.create_task(fuzz(s, url, t, killing))
                tasks.add(fuzzing)
                fuzzing.add_done_callback(tasks.discard)
                next_fuzz = now + args.fuzz_every
            if now >= next_sample:
                next_sample = now + 10
                try:
                    t.samples.append(await sample(s, url, args.server_ref[0], args.t_start))
                except (aiohttp.ClientError, asyncio.TimeoutError, psutil.Error) as e:
                    print(f"sample at {now - args.t_start:.0f} s failed: {e!r}")
            await asyncio.sleep(random.expovariate(rate))
        await asyncio.gather(*tasks, return_exceptions=True)


def loop_lag_ticks(text: str) -> tuple[float, float]:
    """(timer ticks, ticks later than 100 ms) of the API's event-loop lag histogram."""
    count = within = 0.0
    for line in text.splitlines():
        if line.startswith("servelab:api_event_loop_lag_seconds_count"):
            count = float(line.rpartition(" ")[2])
        elif line.startswith("servelab:api_event_loop_lag_seconds_bucket") and 'le="0.1"' in line:
            within = float(line.rpartition(" ")[2])
    return count, count - within


async def capacity(url: str, seconds: float, concurrency: int = 16) -> int:
    """Requests finished in ``seconds`` with ``concurrency`` always in flight (a closed loop:
    an open-loop probe above capacity queues work that takes minutes to drain on a loaded
    machine). What is still running at the end is cancelled (the server aborts it)."""
    t = Tally()
    killing = [False]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:

        async def client() -> None:
            while True:
                await one_request(s, url, t, killing)

        clients = [asyncio.create_task(client()) for _ in range(concurrency)]
        await asyncio.sleep(seconds)
        for c in clients:
            c.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
    return t.ended


async def door(url: str) -> bool:
    """Each of WORST alone, with /health polled every 10 ms from the same client. Prints the
    idle round trip beside the worst one during each request; True if all met the target."""

    async def rtt(s: aiohttp.ClientSession) -> float:
        t1 = time.monotonic()
        async with s.get(f"{url}/health") as r:
            await r.read()
        return time.monotonic() - t1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        idle = []
        for _ in range(50):
            idle.append(await rtt(s))
            await asyncio.sleep(0.01)
        base = statistics.median(idle)
        print(
            f"door: /health idle round trip median {base * 1e3:.1f} ms, max {max(idle) * 1e3:.1f}"
        )
        ok = True
        for name, path, body in WORST:
            headers = {"Content-Type": "application/json"}
            async with s.get(f"{url}/metrics") as m:
                ticks0, late0 = loop_lag_ticks(await m.text())
            t1 = time.monotonic()
            send = asyncio.create_task(s.post(f"{url}{path}", data=body, headers=headers))
            polls = []
            while not send.done():
                polls.append(await rtt(s))
                await asyncio.sleep(0.01)
            r = send.result()
            await r.read()
            took = time.monotonic() - t1
            async with s.get(f"{url}/metrics") as m:
                ticks1, late1 = loop_lag_ticks(await m.text())
            worst = max(polls, default=0.0)
            ok &= worst <= DOOR_TARGET_S and r.status < 500
            print(
                f"door: {name}: {r.status} in {took:.2f} s; /health max {worst * 1e3:.1f} ms "
                f"({worst / base:.0f}x idle) over {len(polls)} polls; the server's loop timer "
                f"late by > 100 ms {late1 - late0:.0f} of {ticks1 - ticks0:.0f} ticks"
            )
        return ok


def slopes_mb_per_min(samples: list[dict], since: float) -> dict[str, float]:
    """Per process alive at the end: the least-squares slope of its RSS since ``since``."""
    out = {}
    for proc in samples[-1]["rss_mb"]:
        pts = [
            (s["t"], s["rss_mb"][proc]) for s in samples if s["t"] >= since and proc in s["rss_mb"]
        ]
        if len(pts) >= 3:
            xs, ys = zip(*pts)
            out[proc] = statistics.linear_regression(xs, ys).slope * 60
    return out


async def _idle_sample(url: str, server: subprocess.Popen[bytes], t0: float) -> dict:
    async with aiohttp.ClientSession() as s:
        for _ in range(60):  # wait for every request to leave the engine
            sample_ = await sample(s, url, server, t0)
            if not sample_["running"]:
                return sample_
            await asyncio.sleep(1.0)
        return sample_


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--rate", type=float, help="requests/s (default: 80%% of a probe)")
    ap.add_argument("--hangup", type=float, default=0.10)
    ap.add_argument("--fuzz-every", type=float, default=3.0)
    ap.add_argument(
        "--kill-at",
        type=float,
        default=0.25,
        help="fraction of the load; early, so the last 20 minutes are the restarted server's",
    )
    ap.add_argument("--door-only", action="store_true", help="only the worst single requests")
    ap.add_argument("--quick", action="store_true", help="3 minutes, for a smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        args.minutes = 3.0
    return args


@dataclass(kw_only=True)
class Soak:
    """What acts 1 to 3 left: the load's tally, the idle sample after it, the drain's tally
    and exit code, and when the load ran (seconds since the start)."""

    t_start: float
    tally: Tally
    idle: dict
    drain: Tally
    exit_code: int
    load_t0: float
    load_t1: float


def run(args: argparse.Namespace, url: str, port: int, server_cpu: int | None) -> Soak:
    """Acts 1 to 3 after the door (``args.server_ref`` holds the running server)."""
    t = Tally(hangup_fraction=args.hangup)
    rate = args.rate
    if rate is None:
        done = asyncio.run(capacity(url, PROBE_S))
        rate = 0.8 * done / PROBE_S
        print(f"capacity probe: {done} requests in {PROBE_S:.0f} s -> soak at {rate:.3f} req/s")

    async def kill_and_restart() -> None:
        pid = core_pid(args.server_ref[0])
        print(f"SIGKILL engine core {pid} at {time.monotonic() - args.t_start:.0f} s")
        os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(2.0)
        old = args.server_ref[0]
        old.send_signal(signal.SIGTERM)
        # In threads, so that the loop sees the old server close its kept-alive connections:
        # blocked, it reused them after the restart ("Can not write request body").
        await asyncio.to_thread(old.wait, 60)
        args.server_ref[0] = await asyncio.to_thread(start_server, server_cpu, port)

    load_t0 = time.monotonic() - args.t_start
    asyncio.run(load(url, rate, args.minutes * 60, t, args, on_half=kill_and_restart))
    load_t1 = time.monotonic() - args.t_start
    server = args.server_ref[0]
    idle = asyncio.run(_idle_sample(url, server, args.t_start))
    # Drain: SIGTERM while requests are in flight; the server must finish them and exit 0.
    drain = Tally()

    async def drain_run() -> None:
        task = asyncio.create_task(load(url, rate, 5.0, drain, args))
        await asyncio.sleep(3.0)
        server.send_signal(signal.SIGTERM)
        await task

    asyncio.run(drain_run())
    return Soak(
        t_start=args.t_start,
        tally=t,
        idle=idle,
        drain=drain,
        exit_code=server.wait(timeout=120),
        load_t0=load_t0,
        load_t1=load_t1,
    )


def show(r: Soak, door_ok: bool) -> bool:
    """Print the results and the verdicts (the door's among them); True when every target
    is met."""
    t, idle = r.tally, r.idle
    # The last 20 minutes of the load, or its last two thirds if it is shorter than 30.
    since = max(r.load_t1 - 20 * 60, r.load_t0 + (r.load_t1 - r.load_t0) / 3)
    print("\n== soak results")
    print(f"requests sent {t.sent}, ended {t.ended}, hung up {t.hung_up}, statuses {t.status}")
    print(f"requests without an end: {t.sent - t.ended} ({t.cut} streams closed without [DONE])")
    print(f"5xx outside the kill window: {t.fivexx_outside_kill}")
    print(f"fuzz requests not answered 4xx: {len(t.fuzz_not_4xx)} {t.fuzz_not_4xx[:5]}")
    for at, what, err in t.failures:
        print(f"  client error at {at - r.t_start:.1f} s ({what}): {err}")
    print(f"KV blocks held once idle (leaked): {idle['kv_blocks_used']}")
    slopes = slopes_mb_per_min(t.samples, since)
    print(f"RSS slope over the last {(r.load_t1 - since) / 60:.0f} min of the load, per process:")
    for proc, slope in slopes.items():
        first = next(s["rss_mb"][proc] for s in t.samples if proc in s["rss_mb"])
        print(
            f"  {proc}: {slope:+.2f} MB/min ({first:.0f} -> {t.samples[-1]['rss_mb'][proc]:.0f} MB)"
        )
    rtts = [s["health_rtt_s"] for s in t.samples]
    print(
        f"/health round trip: median {statistics.median(rtts) * 1e3:.1f} ms, max "
        f"{max(rtts) * 1e3:.1f} ms over {len(rtts)} samples"
    )
    slow = [
        f"{s['t']:.0f} s: {s['health_rtt_s']:.2f} s" for s in t.samples if s["health_rtt_s"] > 1
    ]
    print(f"/health samples over 1 s (seconds since the start): {slow or 'none'}")
    print(f"open fds first/last: {t.samples[0]['fds']} / {t.samples[-1]['fds']}")
    print(f"SIGTERM drain: exit code {r.exit_code}, drain statuses {r.drain.status}")
    verdicts = {
        "/health within 100 ms during each worst single request": door_ok,
        "0 5xx outside the kill": t.fivexx_outside_kill == 0,
        "every fuzz request 4xx": not t.fuzz_not_4xx,
        "0 requests without an end": t.sent == t.ended,
        "0 leaked KV blocks": not idle["kv_blocks_used"],
        "RSS slope <= 1 MB/min in every process": all(v <= 1.0 for v in slopes.values()),
        "SIGTERM drain exits 0": r.exit_code == 0,
    }
    for what, ok in verdicts.items():
        print(f"{'PASS' if ok else 'FAIL'}  {what}")
    return all(verdicts.values())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    server_cpu = cpus[-1] if len(cpus) >= 2 else None
    if server_cpu is not None:
        os.sched_setaffinity(0, {cpus[0]})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(server_cpu, port)
    args.server_ref, args.t_start = [server], time.monotonic()
    door_ok = asyncio.run(door(url))
    if args.door_only:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
        raise SystemExit(0 if door_ok else 1)
    raise SystemExit(0 if show(run(args, url, port, server_cpu), door_ok) else 1)


if __name__ == "__main__":
    main()
