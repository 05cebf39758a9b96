"""`servelab demo`: the main job, four questions answered on the embedded engine.

1. start the embedded engine: one `servelab serve` per configuration the questions need;
2. answer each question with one comparison (interleaved repeats, ``workflows.matrix``):
   - rag_ttft: long RAG prompts with a shared system prompt and documents, prefix caching
     off vs on; TTFT mean;
   - chunked_prefill: chat streams decoding while long unique RAG prompts arrive,
     unchunked vs a 256-token chunk budget; the longest ITL of each chat stream that was
     decoding when a RAG prompt's prefill ended, their mean; TTFT beside it;
   - priorities: interactive chat plus long non-streamed batch jobs on a 2-sequence
     engine, FCFS vs the batch class at a lower priority; chat TTFT p95, batch E2E beside it;
   - decode_itl: codegen at concurrency 1, 2, 4, 8; ITL p50 and throughput vs batch size;
3. print the findings of one run per question and each answer in one sentence;
4. write ``demo.json`` and one HTML report that opens with the answers.

Sizes are chosen so that each effect, where real, is several times its noise at the
sample size a 2-core CPU gets in the time: the full demo aims at under 10 minutes,
``--quick`` (CI) at a couple. All servers start once and are stopped at the end.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from servelab.analyze.answers import MAX_ITL, Answer, Question, answer
from servelab.analyze.compare import Comparison, compare
from servelab.analyze.diagnose import Diagnosis, diagnose
from servelab.bench.request_plan import LoadSpec
from servelab.bench.run import DEFAULT_MODEL, BenchOptions, run_bench
from servelab.report.demo_report import write_demo_report
from servelab.report.terminal import render_answers
from servelab.rundir import Run, load_run
from servelab.workflows.matrix import (
    MatrixConfig,
    MatrixSpec,
    execute_matrix,
    has_records,
    record_server,
    start_servers,
)

# A 1 GB KV pool holds every load below and keeps four servers' memory modest.
KV = "--kv-cache-memory 1G"
SERVERS = {
    # The default engine: a 256-token chunk budget is ~1/6 of a RAG prompt, so a prefill
    # shares steps with decodes instead of stalling them.
    "cached": f"--max-num-batched-tokens 256 {KV}",
    "uncached": f"--max-num-batched-tokens 256 --no-enable-prefix-caching {KV}",
    "unchunked": f"--no-enable-chunked-prefill {KV}",
    # Two sequences at most: a closed loop of six keeps four waiting, which is where a
    # priority acts (the scheduler admits by priority; it preempts only for KV blocks).
    "two-seqs": f"--max-num-batched-tokens 256 --max-num-seqs 2 {KV}",
}
INTERRUPTED = 130
# A permutation test relabels whole requests: one request at concurrency 1 is one cluster,
# and no relabelling of one cluster can reach significance.
MIN_LEVEL_REQUESTS = 4

QUESTIONS = {
    "rag_ttft": Question(
        id="rag_ttft",
        question="RAG TTFT: where does it go, and what does prefix caching save?",
        metric=("overall", "ttft", "mean"),
        cost=("overall", "itl", "p50"),
        baseline="prefix caching off",
        treatment="prefix caching on",
        treatment_effect="with the cache",
    ),
    "chunked_prefill": Question(
        id="chunked_prefill",
        question=(
            "Mixed traffic: does chunked prefill protect the streams decoding while long prompts "
            "arrive?"
        ),
        metric=("chat", MAX_ITL, "mean"),
        cost=("overall", "ttft", "p50"),
        baseline="unchunked",
        treatment="chunked, 256-token budget",
        treatment_effect="chunked",
        during="rag",
    ),
    "priorities": Question(
        id="priorities",
        question=(
            "Interactive vs batch: does a lower priority for batch jobs protect interactive TTFT?"
        ),
        metric=("chat", "ttft", "p95"),
        cost=("batch", "e2e", "p50"),
        baseline="FCFS",
        treatment="batch at priority 1",
        treatment_effect="with priorities",
    ),
    "decode_itl": Question(
        id="decode_itl",
        question="Long outputs: what sets ITL as concurrency rises?",
        metric=("overall", "itl", "p50"),
        cost=("overall", "throughput", "output_tokens_per_s"),
        baseline="concurrency 1",
        treatment="concurrency 8",
        treatment_effect="at concurrency 8",
    ),
}

_SYSTEM = {"name": "system", "count": 1, "tokens": 256, "reuse": 1.0}


def rag_workload(scale: float) -> dict[str, Any]:
    """Q1: prompts of 1.5-1.8k tokens (at scale 1): a shared system prompt, one of two
    documents, a short question; short answers, so TTFT is most of the request."""
    doc = {"dist": "uniform", "min": round(1250 * scale), "max": round(1450 * scale)}
    return {
        "name": "demo-rag",
        "classes": [
            {
                "name": "rag",
                "text": "question",
                "input": {"dist": "uniform", "min": 32, "max": 96},
                "output": {"dist": "uniform", "min": 16, "max": 24},
                "prefix": [
                    {**_SYSTEM, "tokens": round(256 * scale)},
                    {"name": "document", "count": 2, "tokens": doc, "reuse": 1.0},
                ],
                "slo": {"ttft": "6s"},
            }
        ],
    }


def mixed_workload(scale: float) -> dict[str, Any]:
    """Q2: two chat streams for every RAG prompt of 700-800 unique tokens (no cache hit).

    Short chats and a RAG prompt in every third request put several streams mid-decode
    whenever a prompt lands, so the streams the question is about (``Question.during``)
    are many on both sides, not a lucky few (benchmarks/demo_power.py)."""
    return {
        "name": "demo-mixed",
        "classes": [
            {
                "name": "chat",
                "weight": 2,
                "input": {"dist": "uniform", "min": 32, "max": 64},
                "output": {"dist": "uniform", "min": 32, "max": 48},
                "slo": {"itl": "500ms"},
            },
            {
                "name": "rag",
                "text": "question",
                "input": {
                    "dist": "uniform",
                    "min": round(700 * scale),
                    "max": round(800 * scale),
                },
                "output": {"dist": "fixed", "value": 4},
                "slo": {"ttft": "6s"},
            },
        ],
    }


def priority_workload(scale: float, batch_priority: int) -> dict[str, Any]:
    """Q3: short interactive chat, and long non-streamed batch jobs half as often."""
    return {
        "name": f"demo-priorities-{batch_priority}",
        "classes": [
            {
                "name": "chat",
                "weight": 2,
                "input": {"dist": "uniform", "min": 64, "max": 128},
                "output": {"dist": "uniform", "min": 8, "max": 16},
                "slo": {"ttft": "2s"},
            },
            {
                "name": "batch",
                "input": {"dist": "uniform", "min": round(256 * scale), "max": round(384 * scale)},
                "output": {"dist": "uniform", "min": round(32 * scale), "max": round(48 * scale)},
                "stream": False,
                "priority": batch_priority,
                "slo": {"e2e": "120s"},
            },
        ],
    }


def codegen_workload(scale: float) -> dict[str, Any]:
    """Q4: code prompts and long fixed-length outputs, so every level decodes the same."""
    return {
        "name": "demo-codegen",
        "classes": [
            {
                "name": "codegen",
                "text": "code",
                "input": {"dist": "uniform", "min": 96, "max": 192},
                "output": {"dist": "fixed", "value": round(64 * scale)},
            }
        ],
    }


@dataclass(frozen=True)
class DemoSize:
    """How much to run: requests per run (closed loop at ``concurrency``), repeats per config."""

    scale: float  # token lengths of the long parts (documents, RAG prompts, batch jobs)
    requests: dict[str, int]
    concurrency: dict[str, int]
    levels: tuple[int, ...]  # decode_itl's concurrency levels
    per_level: int  # decode_itl: requests per level = per_level x concurrency, >= 4
    repeats: int
    budget: str


FULL = DemoSize(
    scale=1.0,
    # Sizes from benchmarks/demo_power.py (docs/reading-the-report.md): the smallest whose
    # simulated verdicts held over seeds, on steps measured on the loaded 2-core CPU.
    requests={"rag_ttft": 8, "chunked_prefill": 18, "priorities": 18},
    concurrency={"rag_ttft": 1, "chunked_prefill": 6, "priorities": 6},
    levels=(1, 2, 4, 8),
    per_level=1,
    repeats=1,
    budget="under 10 minutes on a 2-core CPU",
)
QUICK = DemoSize(
    scale=0.3,
    # chunked_prefill: enough requests that some chats decode while a RAG prompt arrives,
    # so the smoke run goes through the population filter (no verdict at this size).
    requests={"rag_ttft": 4, "chunked_prefill": 8, "priorities": 6},
    concurrency={"rag_ttft": 1, "chunked_prefill": 4, "priorities": 6},
    levels=(1, 2, 4),
    per_level=1,
    repeats=1,
    budget="a couple of minutes",
)


@dataclass
class DemoResult:
    out: Path
    report: Path | None
    answers: list[Answer]
    comparisons: dict[str, Comparison]
    groups: dict[str, list[list[Run]]]
    diagnoses: dict[str, Diagnosis]
    wall_s: float
    interrupted: bool = False


def _write_workload(out: Path, spec: dict[str, Any]) -> str:
    path = out / "workloads" / f"{spec['name']}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path)


def _opts(out: Path, name: str, workload: str, requests: int, conc: int, seed: int) -> BenchOptions:
    return BenchOptions(
        tokenizer=DEFAULT_MODEL,
        workload=workload,
        load=LoadSpec.from_flags(concurrency=conc, requests=requests),
        out=out / name,
        seed=seed,
        command=["servelab", "demo", f"({name})"],
    )


def run_demo(
    quick: bool = False,
    out: Path | None = None,
    console: Console | None = None,
    size: DemoSize | None = None,
    seed: int = 1,
) -> DemoResult:
    """Run the whole demo (``size`` overrides FULL/QUICK); raises RuntimeError when a
    server cannot start."""
    console = console or Console()
    size = size or (QUICK if quick else FULL)
    out = out or Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-demo{'-quick' if quick else ''}"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    console.rule("[bold]servelab demo" + (" --quick" if quick else ""))
    console.print(
        "Four questions, each answered by one comparison: RAG TTFT and prefix caching, "
        "chunked prefill under mixed traffic, interactive vs batch priorities, what sets ITL; "
        f"expect {size.budget}. Everything lands in {out}."
    )
    console.rule("step 1: start the embedded engine")
    servers = start_servers(SERVERS, out, console=console)
    console.print(f"{len(servers)} engines ready in {time.monotonic() - t0:.0f} s")
    groups: dict[str, list[list[Run]]] = {}
    interrupted = False
    s = size.scale
    fcfs = _write_workload(out, priority_workload(s, 0))
    # (question, workload, [(config, server, workload override)]): baseline first.
    plans = [
        (
            "rag_ttft",
            _write_workload(out, rag_workload(s)),
            [("uncached", "uncached", None), ("cached", "cached", None)],
        ),
        (
            "chunked_prefill",
            _write_workload(out, mixed_workload(s)),
            [("unchunked", "unchunked", None), ("chunked", "cached", None)],
        ),
        (
            "priorities",
            fcfs,
            [
                ("fcfs", "two-seqs", None),
                ("priority", "two-seqs", _write_workload(out, priority_workload(s, 1))),
            ],
        ),
    ]
    code = _write_workload(out, codegen_workload(s))
    try:
        for i, (qid, workload, configs) in enumerate(plans, 1):
            console.rule(f"step 2.{i}: {QUESTIONS[qid].question}")
            spec = MatrixSpec([MatrixConfig(c, SERVERS[k], w) for c, k, w in configs], size.repeats)
            res = execute_matrix(
                spec,
                _opts(out, qid, workload, size.requests[qid], size.concurrency[qid], seed),
                console,
                servers={c: servers[k] for c, k, _ in configs},
            )
            groups[qid] = res.groups
            interrupted = INTERRUPTED in res.exit_codes.values()
            if interrupted:
                break
        if not interrupted:
            console.rule("step 2.4: " + QUESTIONS["decode_itl"].question)
            groups["decode_itl"], interrupted = _levels(out, code, size, servers, console, seed)
    finally:
        with console.status("stopping the engine ..."):
            for srv in servers.values():
                srv.stop()
    return _conclude(out, groups, interrupted, console, t0, seed, size)


def _levels(
    out: Path, workload: str, size: DemoSize, servers: dict[str, Any], console: Console, seed: int
) -> tuple[list[list[Run]], bool]:
    """decode_itl: one run per concurrency level on the default engine, lowest first."""
    runs: list[list[Run]] = []
    for c in size.levels:
        n = max(size.per_level * c, MIN_LEVEL_REQUESTS)
        opts = _opts(out / "decode_itl", f"c{c}", workload, n, c, seed)
        code = run_bench(opts, console)
        run_dir = out / "decode_itl" / f"c{c}"
        if has_records(run_dir):
            record_server(run_dir, servers["cached"])
            runs.append([load_run(run_dir)])
        if code == INTERRUPTED:
            return runs, True
    return runs, False


def _conclude(
    out: Path,
    groups: dict[str, list[list[Run]]],
    interrupted: bool,
    console: Console,
    t0: float,
    seed: int,
    size: DemoSize,
) -> DemoResult:
    console.rule("step 3: findings and answers")
    answers: list[Answer] = []
    comparisons: dict[str, Comparison] = {}
    diagnoses: dict[str, Diagnosis] = {}
    with console.status("comparing and diagnosing ..."):
        for qid, gs in groups.items():
            if len(gs) < 2:
                continue
            q = QUESTIONS[qid]
            labels = [g[0].name.rsplit("-r", 1)[0] for g in gs]
            comparisons[qid] = compare(gs, labels, seed=seed)
            levels = None
            if qid == "decode_itl":  # the levels run (--quick stops at 4, an interrupt earlier)
                levels = (size.levels[0], size.levels[len(gs) - 1])
                q = replace(
                    q,
                    baseline=f"concurrency {levels[0]}",
                    treatment=f"concurrency {levels[1]}",
                    treatment_effect=f"at concurrency {levels[1]}",
                )
            answers.append(answer(q, gs[0], gs[-1], seed=seed, levels=levels))
            # The treatment's first run is the one a reader opens to see why.
            diagnoses[qid] = diagnose(gs[-1][0])
    for qid, d in diagnoses.items():
        console.print(f"[bold]{qid}[/] ({groups[qid][-1][0].name}):")
        if not d.findings:
            console.print("  [green]no findings[/]")
        for f in d.findings:
            console.print(f"  [yellow]> {f.title}[/] [dim]({f.confidence_label})[/]: {f.summary}")
    wall = time.monotonic() - t0
    (out / "demo.json").write_text(
        json.dumps(
            {"questions": [a.to_dict() for a in answers], "wall_s": wall, "seed": seed},
            indent=1,
            default=str,
        )
    )
    report = None
    if answers:
        console.rule("step 4: the HTML report")
        with console.status("writing the report ..."):
            report = write_demo_report(
                answers, comparisons, groups, diagnoses, out / "report.html", wall
            )
        console.print(f"[bold]report: {report.resolve()}[/]")
    console.print(f"demo.json and run directories under {out.resolve()} ({wall:.0f} s in all)")
    if interrupted:
        console.print("[yellow]interrupted: the answers cover what ran[/]")
    render_answers(answers, console)
    return DemoResult(out, report, answers, comparisons, groups, diagnoses, wall, interrupted)
