"""How accurately does the benchmark client time a stream, and what does a token cost it?

The deterministic test server (pinned to one core with taskset) streams tokens on a
known schedule and records when it wrote each chunk; the client (pinned to the other
core) runs N concurrent streams. On one host both use the same monotonic clock, so
for every chunk the client's timing error is ``client stamp - server write``. The
script prints, per concurrency and token rate, the error p50/p99/max, the TTFT error,
the client CPU per streamed token and the token rate one core could sustain. Side by
side, the same streams read with plain aiohttp (``iter_any``, stamping when the
coroutine gets the bytes) show why servelab stamps bytes in ``data_received``.

Targets: p99 error <= 1 ms at 200 streams; >= 20,000 streamed tokens/s per core.

With ``--peers``, the same server then times other benchmark clients beside servelab's: each
client (``servelab bench`` and the peers that ``benchmarks/peers/install.sh`` installed: ``vllm
bench serve``, GuideLLM, AIPerf) runs as a subprocess on the client core, sends the same requests
(about 200 prompt tokens, 60 streamed output tokens, N in flight), and its per-request output
file is joined by request id with the server's timelines. Per client: the TTFT p50/p95 it
reported, the true TTFT p50/p95 of the same requests (server: first token written - request
arrived), their differences, and the error of every inter-chunk gap where the client records them.

    python -m benchmarks.client.client_accuracy            # the full ladder, up to 500 streams
    python -m benchmarks.client.client_accuracy --quick    # a short check
    python -m benchmarks.client.client_accuracy --quick --peers   # and the clients side by side

With ``--join``, the test server serves over kernel-stamped sockets (``testing/stampserver.py``)
and the TTFT of every request is joined by its ``X-Request-Id`` with the server's own (first
token written - the kernel's receive stamp of the request) at 20 and 200 streams
(``--join-streams``), run as ``servelab bench`` runs them (its ``PlanRunner``: a closed loop of N
streams, ``--rounds`` requests each), cold (``--cold-connections``: every stream opens its
connection inside the window) and warm (the default: the pool opened before the clock starts):
the per-request error at p50/p99, split into waiting for a connection, sending, the wire (last
byte written -> the kernel received it) and the client's stamp of the first token (client stamp
- server write); beside it, the error against the server's event-loop clock (the read of the
request's first bytes, as the aiohttp server stamps it) and the difference, the server's read
lag. Levels alternate and repeat (``--repeats``) so that a loaded machine shows as ranges.

    python -m benchmarks.client.client_accuracy --join --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec
import numpy as np

from benchmarks.common import ROOT, fetch_timelines
from benchmarks.peers.clients import (
    ClientFailed,
    Job,
    Reported,
    clients,
    local_tokenizer,
    run_client,
)
from servelab.bench.client.event_loop import run_loop
from servelab.bench.client.http import HttpClient
from servelab.bench.client.send import Target, send
from servelab.bench.plan_runner import PlanRunner
from servelab.bench.workloads.request_plan import LoadSpec
from servelab.rundir import server_id
from servelab.testing.testserver import Schedule, run_test_server
from servelab.testing.tokenizers import one_request
from servelab.vocab import RequestTags


@dataclass
class Level:
    streams: int
    itl: float
    tokens: int


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _schedule_header(lv: Level) -> dict[str, str]:
    """The test server takes a per-request schedule from this header."""
    return {"X-Test-Schedule": msgspec.json.encode({"itl": lv.itl}).decode()}


async def _servelab_streams(url: str, lv: Level, tag: str) -> list[tuple[str, float, list[float]]]:
    http = HttpClient(url)
    target = Target(url, "test-model", extra_headers=_schedule_header(lv))

    async def one(i: int) -> tuple[str, float, list[float]]:
        req = one_request(f"{tag}-{i}", "hello", lv.tokens, tags=RequestTags(workload_class="x"))
        out = await send(http, target, req, prompt=req.prompt, intended_send=time.monotonic())
        r = out.record
        if not r.ok:
            raise RuntimeError(r.error)
        return server_id(r), r.actual_send, r.chunk_times

    res = await asyncio.gather(*(one(i) for i in range(lv.streams)))
    await http.close()
    return list(res)


async def _aiohttp_streams(url: str, lv: Level, tag: str) -> list[tuple[str, float, list[float]]]:
    """The common way: aiohttp, stamp when the coroutine receives the bytes."""
    conn = aiohttp.TCPConnector(limit=0)
    decode = msgspec.json.Decoder().decode
    async with aiohttp.ClientSession(connector=conn) as s:

        async def one(i: int) -> tuple[str, float, list[float]]:
            rid = f"{tag}-{i}"
            body = {
                "model": "test-model",
                "prompt": "hello",
                "max_tokens": lv.tokens,
                "stream": True,
            }
            times: list[float] = []
            buf = b""
            sent = time.monotonic()
            async with s.post(
                f"{url}/v1/completions",
                json=body,
                headers={"X-Request-Id": rid, **_schedule_header(lv)},
            ) as r:
                async for data in r.content.iter_any():
                    t = time.monotonic()
                    buf += data
                    while b"\n\n" in buf:
                        ev, buf = buf.split(b"\n\n", 1)
                        payload = ev[6:]
                        if payload != b"[DONE]":
                            d = decode(payload)
                            if d["choices"] and d["choices"][0].get("text"):
                                times.append(t)
            return rid, sent, times

        return list(await asyncio.gather(*(one(i) for i in range(lv.streams))))


async def measure(url: str, lv: Level, client: str, tag: str) -> dict[str, float]:
    run = _servelab_streams if client == "servelab" else _aiohttp_streams
    c0, t0 = _cpu(), time.monotonic()
    res = await run(url, lv, tag)
    cpu, wall = _cpu() - c0, time.monotonic() - t0
    tls = await fetch_timelines(url, [rid for rid, _, _ in res])
    errors, ttft_err = [], []
    for rid, sent, times in res:
        tl = tls[rid]
        writes = tl["token_times"]
        if len(writes) != len(times):
            raise RuntimeError(f"{rid}: {len(times)} chunks seen, {len(writes)} written")
        errors.extend(np.asarray(times) - np.asarray(writes))
        ttft_err.append((times[0] - sent) - (tl["first_token"] - tl["arrival"]))
    e = np.asarray(errors) * 1e3
    tokens = lv.streams * lv.tokens
    return {
        "err_p50_ms": float(np.percentile(e, 50)),
        "err_p99_ms": float(np.percentile(e, 99)),
        "err_max_ms": float(e.max()),
        "ttft_err_p99_ms": float(np.percentile(np.asarray(ttft_err) * 1e3, 99)),
        "cpu_us_per_token": cpu / tokens * 1e6,
        "tokens_per_s": tokens / wall,
        "tokens_per_core_s": tokens / cpu if cpu > 0 else float("inf"),
    }


async def _fetch_arrivals(url: str, ids: list[str]) -> dict[str, dict[str, float]]:
    """The stamp server's arrival stamps of the requests ``ids`` (100 ids a query)."""
    out: dict[str, dict[str, float]] = {}
    async with aiohttp.ClientSession() as s:
        for i in range(0, len(ids), 100):
            q = {"ids": ",".join(ids[i : i + 100])}
            async with s.get(f"{url}/test/arrivals", params=q) as r:
                out.update(await r.json())
    return out


async def _joined(url: str, streams: int, rounds: int, warm: bool) -> dict[str, float]:
    """``streams`` closed-loop streams run by the bench's own runner against the stamp server;
    each request's TTFT error joined by id, against the kernel's receive stamp and the server's
    event-loop read."""
    lv = Level(streams, 0.015, 20)
    http = HttpClient(url)
    target = Target(
        url, "test-model", extra_headers=_schedule_header(lv), cold_connections=not warm
    )
    plan = [
        one_request(f"j{i}", "hello", lv.tokens, tags=RequestTags(workload_class="x"))
        for i in range(streams * rounds)
    ]
    load = LoadSpec(concurrency=streams, requests=len(plan))
    res = await PlanRunner(http, target, load, run_tag=f"join{streams}").run(plan)
    await http.close()
    recs = res.records
    if bad := [r.error for r in recs if not r.ok]:
        raise RuntimeError(f"{len(bad)} requests failed: {bad[0]}")
    ids = [server_id(r) for r in recs]
    tls, arrivals = await fetch_timelines(url, ids), await _fetch_arrivals(url, ids)
    # err = conn + send + wire + stamp: waiting for a connection, sending, the request's way from
    # its last byte written to the kernel's receipt of it, and the client's stamp of the first
    # token after the server's write; loop = err + lag, the server's read after the kernel's
    keys = ("err", "loop", "conn", "send", "wire", "lag", "stamp")
    rows: dict[str, list[float]] = {k: [] for k in keys}
    new = unstamped = 0
    for r in recs:
        tl, a = tls[server_id(r)], arrivals[server_id(r)]
        kernel = a.get("kernel", a["read"])
        unstamped += "kernel" not in a
        assert r.ttft is not None and r.request_written is not None
        rows["err"].append(r.ttft - (tl["first_token"] - kernel))
        rows["loop"].append(r.ttft - (tl["first_token"] - a["read"]))
        rows["conn"].append(r.connection_wait or 0.0)
        rows["send"].append(r.send_time or 0.0)
        rows["wire"].append(kernel - r.request_written)
        rows["lag"].append(a["read"] - kernel)
        rows["stamp"].append(r.chunk_times[0] - tl["first_token"])
        new += bool(r.new_connection)
    out = {"new": float(new), "n": float(len(recs)), "unstamped": float(unstamped)}
    out["setup_ms"] = 1e3 * float((res.connections or {}).get("seconds", 0.0))
    for k, v in rows.items():
        a = np.asarray(v) * 1e3
        out[f"{k}_p50"], out[f"{k}_p99"] = float(np.percentile(a, 50)), float(np.percentile(a, 99))
    return out


JOIN_LEGEND = """
TTFT joined by X-Request-Id with the server's (closed loop, {rounds} requests a stream; ms)
err   client TTFT - the server's, from the kernel's receive stamp: conn + send + wire + stamp
loop  the same error against the server's event-loop read of the request: err + lag
conn  waiting for a connection      send  connection ready -> the request's last byte written
wire  last byte written -> the kernel received it   lag   -> the server's event loop read it
stamp the client's stamp of the first token - the server's write of it
setup the warm pool's set-up, before the clock""".strip("\n")


def join_table(url: str, repeats: int, rounds: int, levels: list[int]) -> None:
    """The TTFT error per request, joined by id, at each stream count, cold and warm."""
    print("\n" + JOIN_LEGEND.format(rounds=rounds))
    print(
        f"{'streams':>7} {'conns':>5} {'rep':>3} {'new':>4} {'err50':>6} {'err99':>6} "
        f"{'loop50':>6} {'loop99':>6} {'conn99':>6} {'send99':>6} {'wire99':>6} "
        f"{'lag50':>6} {'lag99':>6} {'stamp99':>7} {'setup':>5}"
    )
    for rep in range(repeats):
        for streams in levels:
            for warm in (False, True):
                m = run_loop(_joined(url, streams, rounds, warm))
                print(
                    f"{streams:7d} {'warm' if warm else 'cold':>5} {rep:3d} {m['new']:4.0f} "
                    f"{m['err_p50']:6.2f} {m['err_p99']:6.2f} {m['loop_p50']:6.2f} "
                    f"{m['loop_p99']:6.2f} {m['conn_p99']:6.2f} {m['send_p99']:6.3f} "
                    f"{m['wire_p99']:6.3f} {m['lag_p50']:6.2f} {m['lag_p99']:6.2f} "
                    f"{m['stamp_p99']:7.3f} {m['setup_ms'] if warm else float('nan'):5.1f}",
                    flush=True,
                )
                if m["unstamped"]:
                    print(f"  ({m['unstamped']:.0f} requests had no kernel stamp: err = loop)")


def compare(reported: list[Reported], tls: dict[str, dict]) -> dict[str, float | int]:
    """A client's reported TTFTs and gaps against the server's timelines of the same requests."""
    rep, true, itl_err = [], [], []
    unmatched = gaps_differ = 0
    for r in reported:
        tl = tls.get(r.request_id)
        if tl is None or tl["first_token"] is None:
            unmatched += 1
            continue
        rep.append(r.ttft)
        true.append(tl["first_token"] - tl["arrival"])
        if r.itls is not None:
            gaps = np.diff(tl["token_times"])
            if len(gaps) == len(r.itls):
                itl_err.extend(np.asarray(r.itls) - gaps)
            else:
                gaps_differ += 1
    if not rep:
        raise ClientFailed("none of its request ids is known to the server")
    rep_ms, true_ms = np.asarray(rep) * 1e3, np.asarray(true) * 1e3
    out: dict[str, float | int] = {
        "n": len(rep),
        "unmatched": unmatched,
        "gaps_differ": gaps_differ,
    }
    for q in (50, 95):
        out[f"rep_p{q}"] = float(np.percentile(rep_ms, q))
        out[f"true_p{q}"] = float(np.percentile(true_ms, q))
        out[f"err_p{q}"] = out[f"rep_p{q}"] - out[f"true_p{q}"]
    if itl_err:
        e = np.asarray(itl_err) * 1e3
        out["itl_err_p50"] = float(np.percentile(e, 50))
        out["itl_err_p99"] = float(np.percentile(e, 99))
    return out


def compare_clients(
    url: str, streams: list[int], tokens: int, peers_dir: Path, out_dir: Path, cpu: int | None
) -> None:
    """Run every client at each stream count against the server at ``url``; print a table."""
    try:
        tok = local_tokenizer(peers_dir / "hf-cache")
    except ClientFailed as e:
        print(f"\nno client comparison: the peers' tokenizer could not be made ({e})")
        return
    print(
        f"\nclients side by side: {tokens} output tokens, ~200 prompt tokens, /v1/completions; "
        f"outputs in {out_dir}"
    )
    print(
        f"{'client':9} {'streams':>7} {'n':>4} {'TTFT p50':>8} {'true':>6} {'err':>7} "
        f"{'TTFT p95':>8} {'true':>6} {'err':>7} {'ITL err p50':>11} {'p99':>7}  note"
    )
    for n in streams:
        for client in clients(peers_dir):
            job = Job(
                url=url,
                streams=n,
                requests=max(100, 2 * n),
                tokens=tokens,
                tag=f"{client.name}-{n}-{os.getpid()}",
            )
            try:
                reported, note = run_client(client, job, tok, out_dir / f"{n}-{client.name}", cpu)
                tls = run_loop(fetch_timelines(url, [r.request_id for r in reported]))
                m = compare(reported, tls)
            except (ClientFailed, OSError, subprocess.SubprocessError, aiohttp.ClientError) as e:
                print(f"{client.name:9} {n:7d}  skipped: {e}", flush=True)
                continue
            notes = [note] if note else []
            if m["n"] < job.requests:
                notes.append(f"{job.requests - m['n']} of {job.requests} requests not reported")
            if m["gaps_differ"]:
                notes.append(f"{m['gaps_differ']} requests' gap counts differ from the server's")
            itl = (
                f"{m['itl_err_p50']:11.3f} {m['itl_err_p99']:7.3f}"
                if "itl_err_p50" in m
                else f"{'-':>11} {'-':>7}"
            )
            print(
                f"{client.name:9} {n:7d} {m['n']:4d} {m['rep_p50']:8.1f} {m['true_p50']:6.1f} "
                f"{m['err_p50']:+7.1f} {m['rep_p95']:8.1f} {m['true_p95']:6.1f} "
                f"{m['err_p95']:+7.1f} {itl}  {'; '.join(notes)}",
                flush=True,
            )
    print("(ms; err = reported - true percentile; ITL err per inter-chunk gap, reported - written)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few small levels only")
    ap.add_argument("--no-aiohttp", action="store_true", help="skip the plain-aiohttp comparison")
    ap.add_argument(
        "--peers", action="store_true", help="then time servelab bench and the peer clients"
    )
    ap.add_argument(
        "--peers-dir",
        type=Path,
        default=ROOT / ".venv-peers",
        help="where benchmarks/peers/install.sh put the peers' venvs",
    )
    ap.add_argument(
        "--join", action="store_true", help="only the per-request TTFT error joined by id"
    )
    ap.add_argument("--repeats", type=int, default=3, help="--join: rounds of all levels")
    ap.add_argument("--rounds", type=int, default=3, help="--join: requests per stream")
    ap.add_argument("--join-streams", default="20,200", help="--join: the stream counts")
    ap.add_argument("--peer-streams", default="20,200", help="stream counts for --peers")
    ap.add_argument(
        "--peers-out",
        type=Path,
        default=ROOT / "runs" / "client_peers",
        help="the clients' output files",
    )
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    client_cpu, server_cpu = cpus[0], cpus[-1]
    if len(cpus) > 1:
        os.sched_setaffinity(0, {client_cpu})
    levels = (
        [Level(20, 0.015, 60), Level(200, 0.015, 60)]
        if args.quick
        else [Level(n, itl, 60) for itl in (0.015, 0.005) for n in (1, 20, 100, 200, 500)]
    )
    sched = Schedule(ttft=0.1, itl=0.015, stall_every=25, stall=0.12)
    print(
        f"client on cpu {client_cpu}, test server on cpu {server_cpu} "
        f"(load average {os.getloadavg()[0]:.1f}: other load inflates every figure)"
    )
    header = (
        f"{'client':9} {'streams':>7} {'itl ms':>6} {'err p50':>8} {'err p99':>8} "
        f"{'err max':>8} {'TTFT err p99':>12} {'us/token':>8} {'tok/s':>8} {'tok/s/core':>10}"
    )
    server_cpu_arg = server_cpu if len(cpus) > 1 else None
    with run_test_server(sched, cpu=server_cpu_arg, kernel_stamps=args.join) as url:
        if args.join:
            join_table(
                url, args.repeats, args.rounds, [int(n) for n in args.join_streams.split(",")]
            )
            return
        print(header)
        for i, lv in enumerate(levels):
            for client in ("servelab",) + (() if args.no_aiohttp else ("aiohttp",)):
                m = run_loop(measure(url, lv, client, f"L{i}-{client}"))
                print(
                    f"{client:9} {lv.streams:7d} {lv.itl * 1e3:6.0f} {m['err_p50_ms']:8.3f} "
                    f"{m['err_p99_ms']:8.3f} {m['err_max_ms']:8.2f} {m['ttft_err_p99_ms']:12.2f} "
                    f"{m['cpu_us_per_token']:8.1f} {m['tokens_per_s']:8.0f} "
                    f"{m['tokens_per_core_s']:10.0f}",
                    flush=True,
                )
        if args.peers:
            compare_clients(
                url,
                [int(n) for n in args.peer_streams.split(",")],
                60,
                args.peers_dir,
                args.peers_out,
                client_cpu if len(cpus) > 1 else None,
            )


if __name__ == "__main__":
    main()
