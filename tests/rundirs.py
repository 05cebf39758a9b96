"""Synthetic run directories with planted causes, for the analysis tests.

A tiny deterministic engine model (continuous batching, optional chunked prefill, a
paged KV pool with preemption, prefix caching by group) produces server timelines
and step records; a client model on top produces the client records. Everything
shares one clock, as a real servelab run on one host does. Each scenario function
plants one cause and writes a complete run directory.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from servelab.analyze.summary import summarize
from servelab.rundir import load_run
from servelab.vocab import (
    ClientRecord,
    FinishReason,
    PrefillChunk,
    RequestTimeline,
    StepRecord,
)

T0 = 1000.0  # monotonic seconds at the start of every synthetic run


@dataclass
class Req:
    rid: str
    cls: str
    intended: float  # offset from T0
    input_tokens: int
    output_tokens: int
    prefix_group: str | None = None
    prefix_tokens: int = 0
    priority: int = 0
    stage: str | None = None  # sweep stage label


@dataclass
class Engine:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 16
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    block_size: int = 16
    num_kv_blocks: int = 4096
    step_overhead: float = 0.004
    prefill_cost: float = 0.0001  # seconds per prompt token
    decode_cost: float = 0.001  # seconds per decoding sequence
    noise: float = 0.03

    def config(self) -> dict:
        keys = (
            "max_num_batched_tokens",
            "max_num_seqs",
            "enable_chunked_prefill",
            "enable_prefix_caching",
            "block_size",
            "num_kv_blocks",
        )
        return {k: getattr(self, k) for k in keys}


@dataclass
class Client:
    net: float = 0.001  # one-way loopback + HTTP handling
    min_send_interval: float = 0.0  # a client that cannot send faster than this lags
    recv_stall_every: int = 0  # every n-th chunk is handed over late
    recv_stall: float = 0.0


@dataclass
class _State:
    req: Req
    tl: RequestTimeline
    computed: int = 0  # tokens in the KV cache
    target: int = 0  # tokens to compute before sampling (prompt + recomputed output)
    emitted: int = 0
    blocks: int = 0
    admitted_at: int = 0


@dataclass
class _Sim:
    eng: Engine
    rng: random.Random
    steps: list[StepRecord] = field(default_factory=list)
    free_blocks: int = 0
    cached_groups: set[str] = field(default_factory=set)


def _blocks(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


def simulate(reqs: list[Req], eng: Engine, client: Client, seed: int = 0):
    """Run the engine and client models; returns (records, timelines, steps)."""
    rng = random.Random(seed)
    sim = _Sim(eng, rng, free_blocks=eng.num_kv_blocks)
    sends: dict[str, float] = {}
    last_send = -math.inf
    for r in sorted(reqs, key=lambda r: r.intended):
        send = max(T0 + r.intended, last_send + client.min_send_interval)
        sends[r.rid] = last_send = send
    arrivals = sorted(reqs, key=lambda r: sends[r.rid])
    states: dict[str, _State] = {}
    waiting: list[_State] = []
    running: list[_State] = []
    t = T0
    i = 0
    admit_seq = 0
    while i < len(arrivals) or waiting or running:
        while i < len(arrivals) and sends[arrivals[i].rid] + client.net <= t:
            r = arrivals[i]
            arr = sends[r.rid] + client.net
            st = _State(r, RequestTimeline(r.rid, arr, r.priority, r.input_tokens, queued=[arr]))
            st.target = r.input_tokens
            states[r.rid] = st
            waiting.append(st)
            i += 1
        if not waiting and not running:
            t = sends[arrivals[i].rid] + client.net
            continue
        waiting.sort(key=lambda s: (s.req.priority, s.tl.queued[-1]))
        budget = eng.max_num_batched_tokens
        prefill: dict[str, int] = {}
        decode: list[str] = []
        preempted: list[str] = []
        first_chunk: dict[str, int] = {}
        # Running decodes first; a decode that needs a block it cannot get preempts the newest.
        for st in sorted(running, key=lambda s: s.admitted_at):
            if st not in running or st.computed < st.target:
                continue
            need = _blocks(st.computed + 1, eng.block_size) - st.blocks
            while need > sim.free_blocks:
                victim = max(running, key=lambda s: s.admitted_at)
                running.remove(victim)
                sim.free_blocks += victim.blocks
                victim.blocks = victim.computed = 0
                victim.target = victim.req.input_tokens + victim.emitted
                victim.tl.preemptions.append(t)
                victim.tl.queued.append(t)
                preempted.append(victim.req.rid)
                waiting.insert(0, victim)
                if victim is st:
                    break
            if st not in running:
                continue
            sim.free_blocks -= need
            st.blocks += need
            decode.append(st.req.rid)
            budget -= 1
        # Unfinished prefills of running requests, then admissions.
        for st in running:
            if st.computed < st.target and budget > 0:
                n = _chunk(st, budget, bool(prefill), eng)
                if n:
                    prefill[st.req.rid] = n
                    budget -= n
        while waiting and budget > 0 and len(running) < eng.max_num_seqs:
            st = waiting[0]
            cached = 0
            g = st.req.prefix_group
            if eng.enable_prefix_caching and g in sim.cached_groups and not st.tl.scheduled:
                cached = min(
                    (st.req.prefix_tokens // eng.block_size) * eng.block_size, st.target - 1
                )
            need = _blocks(st.target, eng.block_size)
            if need > sim.free_blocks:
                break
            n = _chunk(st, budget, bool(prefill), eng, skip=cached)
            if n == 0:
                break
            waiting.pop(0)
            sim.free_blocks -= need
            st.blocks = need
            st.computed = cached
            st.tl.cached_tokens += cached
            st.tl.scheduled.append(t)
            admit_seq += 1
            st.admitted_at = admit_seq
            running.append(st)
            prefill[st.req.rid] = n
            first_chunk[st.req.rid] = cached
            budget -= n
        ptok = sum(prefill.values())
        if not prefill and not decode and not running:
            raise ValueError(f"request {waiting[0].req.rid} can never fit in the KV pool")
        dur = eng.step_overhead + eng.prefill_cost * ptok + eng.decode_cost * len(decode)
        dur *= math.exp(rng.gauss(0.0, eng.noise))
        end = t + dur
        step_id = len(sim.steps)
        finished: list[_State] = []
        for rid, n in prefill.items():
            st = states[rid]
            st.tl.chunks.append(PrefillChunk(step_id, t, end, n, first_chunk.get(rid, 0)))
            st.computed += n
            if st.computed >= st.target:
                if st.req.prefix_group:
                    sim.cached_groups.add(st.req.prefix_group)
                _emit(st, end, finished)
        for rid in decode:
            st = states[rid]
            st.computed += 1
            _emit(st, end, finished)
        for st in finished:
            running.remove(st)
            sim.free_blocks += st.blocks
            st.blocks = 0
        sim.steps.append(
            StepRecord(
                step_id=step_id,
                start=t,
                end=end,
                prefill_tokens=ptok,
                decode_seqs=len(decode),
                prefill=prefill,
                decode=decode,
                kv_blocks_used=eng.num_kv_blocks - sim.free_blocks,
                kv_blocks_total=eng.num_kv_blocks,
                num_waiting=len(waiting),
                preempted=preempted,
            )
        )
        t = end + 0.0002  # scheduler bookkeeping between steps
    records = [_client_record(states[r.rid], sends[r.rid], client) for r in reqs]
    return records, [states[r.rid].tl for r in reqs], sim.steps


def _chunk(st: _State, budget: int, others: bool, eng: Engine, skip: int = 0) -> int:
    remaining = st.target - max(st.computed, skip)
    if eng.enable_chunked_prefill:
        return min(remaining, budget)
    # Unchunked: the whole prompt in one step; it may overrun the budget if it goes first.
    return remaining if (remaining <= budget or not others) else 0


def _emit(st: _State, t: float, finished: list[_State]) -> None:
    st.emitted += 1
    st.target = st.computed
    if st.tl.first_token is None:
        st.tl.first_token = t
    st.tl.token_times.append(t)
    st.tl.output_tokens = st.emitted
    if st.emitted >= st.req.output_tokens:
        st.tl.finished = t
        st.tl.finish_reason = FinishReason.LENGTH
        finished.append(st)


def _client_record(st: _State, send: float, client: Client) -> ClientRecord:
    r = st.req
    chunk_times = []
    lag = 0.0
    for k, tt in enumerate(st.tl.token_times):
        if client.recv_stall_every and k and k % client.recv_stall_every == 0:
            lag += client.recv_stall
        chunk_times.append(tt + client.net + lag)
    return ClientRecord(
        request_id=r.rid,
        workload_class=r.cls,
        intended_send=T0 + r.intended,
        actual_send=send,
        input_tokens=r.input_tokens,
        output_tokens=len(chunk_times),
        requested_output_tokens=r.output_tokens,
        first_byte=st.tl.arrival + 0.0005,
        chunk_times=chunk_times,
        chunk_tokens=[1] * len(chunk_times),
        done=chunk_times[-1] + 0.0005,
        status=200,
        prefix_group=r.prefix_group,
        stage=r.stage,
        server_timeline=st.tl.summary(),
    )


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def write_run(
    path: Path,
    reqs: list[Req],
    eng: Engine | None = None,
    client: Client | None = None,
    seed: int = 0,
    workload: dict | None = None,
    model: str = "smollm2-135m",
    target_kind: str = "servelab",
    **manifest: object,
) -> Path:
    """Simulate and write a complete run directory at ``path``."""
    eng = eng or Engine()
    client = client or Client()
    records, timelines, steps = simulate(reqs, eng, client, seed)
    path.mkdir(parents=True, exist_ok=True)
    start = min(r.actual_send for r in records)
    end = max(r.done for r in records if r.done is not None)
    man = {
        "name": path.name,
        "command": "servelab bench (synthetic)",
        "versions": {"servelab": "0.1.0"},
        "machine": {"cpus": 2},
        "format_version": 2,
        "server": {"model": model, "engine_config": eng.config()},
        "workload": workload or {"name": "synthetic"},
        "valid": True,
        "invalid_reason": None,
        "simulated": True,
        "window": {"start": start, "end": end},
        "target_kind": target_kind,
    }
    man.update(manifest)
    (path / "manifest.json").write_text(json.dumps(man, indent=1))
    _write_jsonl(path / "requests.jsonl", [r.to_dict() for r in records])
    stages = list(dict.fromkeys(r.stage for r in records if r.stage is not None))
    if stages:  # a sweep: per-stage bodies, as `servelab bench --sweep` writes them
        metrics = {
            "stages": [
                {"label": s, "metrics": summarize([r for r in records if r.stage == s], n_boot=0)}
                for s in stages
            ]
        }
    else:
        metrics = summarize(records, n_boot=200)
    (path / "metrics.json").write_text(json.dumps(metrics))
    if target_kind == "servelab":
        _write_jsonl(path / "server.jsonl", [t.to_dict() for t in timelines])
        _write_jsonl(path / "steps.jsonl", [s.to_dict() for s in steps])
    return path


# --- workloads -------------------------------------------------------------------------


def poisson(n: int, rate: float, rng: random.Random) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def chat_requests(
    n: int,
    rate: float,
    seed: int,
    inputs: tuple[int, int] = (100, 140),
    outputs: tuple[int, int] = (20, 30),
    cls: str = "chat",
    prefix: str = "c",
) -> list[Req]:
    rng = random.Random(seed)
    return [
        Req(f"{prefix}{k}", cls, t, rng.randint(*inputs), rng.randint(*outputs))
        for k, t in enumerate(poisson(n, rate, rng))
    ]


# --- scenarios: each plants one cause ----------------------------------------------------


def calm(
    path: Path, seed: int = 0, noise_seed: int | None = None, slowdown: float = 1.0, **kw
) -> Path:
    """Light steady load, similar prompts: nothing to find.

    ``seed`` draws the workload (as a benchmark's workload seed does); ``noise_seed`` the
    step-time noise, so two runs of one workload differ only by machine noise.
    ``slowdown`` scales every step cost (a planted regression).
    """
    eng = Engine(
        step_overhead=0.004 * slowdown, prefill_cost=0.0001 * slowdown, decode_cost=0.001 * slowdown
    )
    noise = seed if noise_seed is None else noise_seed
    return write_run(path, chat_requests(80, 4.0, seed), eng, seed=noise, **kw)


def burst(path: Path, seed: int = 0) -> Path:
    """Queueing: 80 requests land within 40 ms on an engine that runs 8 sequences at a time."""
    rng = random.Random(seed)
    reqs = [
        Req(f"b{k}", "chat", rng.uniform(0, 0.04), rng.randint(100, 140), 25) for k in range(80)
    ]
    return write_run(path, reqs, Engine(max_num_seqs=8), seed=seed)


def prefill_bound(path: Path, seed: int = 0) -> Path:
    """Prompts from 100 to 4000 tokens, one at a time: TTFT is the prompt's prefill."""
    rng = random.Random(seed)
    reqs = [Req(f"p{k}", "rag", 1.0 * k, rng.randint(100, 4000), 8) for k in range(40)]
    return write_run(path, reqs, seed=seed)


def unchunked_stalls(path: Path, seed: int = 0) -> Path:
    """Short chats decoding while rare 3000-token prompts arrive, chunked prefill off."""
    reqs = chat_requests(60, 8.0, seed, outputs=(40, 60))
    rng = random.Random(seed + 1)
    reqs += [Req(f"d{k}", "rag", 0.4 + 1.6 * k + rng.uniform(0, 0.1), 3000, 4) for k in range(4)]
    eng = Engine(enable_chunked_prefill=False, max_num_batched_tokens=512)
    return write_run(path, reqs, eng, seed=seed)


def preemptions(path: Path, seed: int = 0) -> Path:
    """A KV pool too small for the decodes it admits: requests are preempted and recomputed."""
    rng = random.Random(seed)
    reqs = [
        Req(f"k{k}", "chat", 0.05 * k, rng.randint(100, 140), rng.randint(90, 110))
        for k in range(24)
    ]
    return write_run(path, reqs, Engine(num_kv_blocks=80), seed=seed)


def lagging_client(path: Path, seed: int = 0) -> Path:
    """The client can only send one request per 60 ms and hands chunks over late."""
    client = Client(min_send_interval=0.06, recv_stall_every=7, recv_stall=0.08)
    return write_run(path, chat_requests(80, 30.0, seed), client=client, seed=seed)


def shared_prefix(path: Path, seed: int = 0, caching: bool = False) -> Path:
    """Requests in 4 groups sharing 1024-token system prompts, with prefix caching off."""
    rng = random.Random(seed)
    reqs = [
        Req(f"s{k}", "agent", t, 1024 + rng.randint(50, 100), 20, f"g{k % 4}", 1024)
        for k, t in enumerate(poisson(60, 3.0, rng))
    ]
    return write_run(path, reqs, Engine(enable_prefix_caching=caching), seed=seed)


def _vllm_figures(tl) -> dict:
    """What the client stores of vLLM's per-request ``metrics`` for this timeline."""
    return {
        "reported_by": "vllm metrics",
        "queue_time": tl.queue_time,
        "prefill_time": tl.prefill_time,
        "decode_time": tl.decode_time,
    }


def as_other_target(path: Path, scrape: bool = True, figures: bool = False) -> Path:
    """Turn a servelab run dir into what a run against another server leaves behind:
    no timelines or steps, no per-request server summary (or, with ``figures``, vLLM's
    per-request ``metrics``), and (optionally) vLLM-named /metrics scrapes taken before
    and after the run."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    run = load_run(path)
    timelines, steps = list(run.timelines.values()), run.steps
    (path / "server.jsonl").unlink()
    (path / "steps.jsonl").unlink()
    rows = []
    for r in run.records:
        tl = run.timeline_for(r)
        server = _vllm_figures(tl) if figures and tl is not None else None
        rows.append(r.to_dict() | {"server_timeline": server})
    _write_jsonl(path / "requests.jsonl", rows)
    man = json.loads((path / "manifest.json").read_text())
    man["target_kind"] = "other"
    man["server"] = {"model": man["server"]["model"]}  # another server's config is unknown
    (path / "manifest.json").write_text(json.dumps(man))
    if not scrape:
        return path
    reg = CollectorRegistry()
    buckets = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)
    hist = {
        name: Histogram(name, name, registry=reg, buckets=buckets)
        for name in (
            "vllm:time_to_first_token_seconds",
            "vllm:request_queue_time_seconds",
            "vllm:request_prefill_time_seconds",
        )
    }
    pre = Counter("vllm:num_preemptions", "preemptions", registry=reg)
    hist["vllm:time_to_first_token_seconds"].observe(0.05)  # traffic before the window
    before = generate_latest(reg).decode()
    for tl in timelines:
        hist["vllm:time_to_first_token_seconds"].observe(tl.first_token - tl.arrival)
        hist["vllm:request_queue_time_seconds"].observe(tl.queue_time)
        hist["vllm:request_prefill_time_seconds"].observe(tl.prefill_time)
    pre.inc(sum(len(s.preempted) for s in steps))
    after = generate_latest(reg).decode()
    start, end = man["window"]["start"], man["window"]["end"]
    with open(path / "metrics_scrape.jsonl", "w") as f:
        f.write(json.dumps({"t": start, "text": before}) + "\n")
        f.write(json.dumps({"t": end, "text": after}) + "\n")
    return path


def sweep(path: Path, seed: int = 0) -> Path:
    """Two load stages, one after the other: 4 then 16 requests/s."""
    reqs = []
    t = 0.0
    for label, rate in (("rate=4", 4.0), ("rate=16", 16.0)):
        stage = chat_requests(60, rate, seed, prefix=f"{label}-")
        for r in stage:
            r.intended += t
            r.stage = label
        t = max(r.intended for r in stage) + 2.0
        reqs += stage
    return write_run(path, reqs, Engine(max_num_seqs=8), seed=seed)


class StandIn:
    """Quacks like bench.target.LaunchedServer, over the bench's deterministic test server.

    For tests of code that starts `servelab serve` (the matrix, the demo) without loading
    a model: "--slow" in the flags doubles the token gap. ``started`` lists the flags of
    every stand-in started, ``models`` the model each was asked to serve (reset them per
    test).
    """

    started: ClassVar[list[str]] = []
    models: ClassVar[list[str]] = []

    def __init__(
        self,
        model: str,
        engine_args: str,
        log_path: Path,
        api_key: str | None = None,
        announce: Callable[[str], None] | None = None,
    ):
        from servelab.testing.testserver import Schedule, TestServer

        self.engine_args = engine_args
        self.command = ["stand-in", engine_args]
        if announce is not None:
            announce(f"launching: {' '.join(self.command)}")
        StandIn.models.append(model)
        itl = 0.02 if "--slow" in engine_args else 0.01
        self._cm = TestServer(Schedule(ttft=0.02, itl=itl)).running()
        self.url = self._cm.__enter__()
        StandIn.started.append(engine_args)

    async def wait_healthy(self, timeout: float | None = None, status: object = None) -> None:
        return None

    def stop(self, grace: float = 0.0) -> None:
        self._cm.__exit__(None, None, None)
