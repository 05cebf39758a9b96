"""`servelab demo`: the main job, six questions answered on the embedded engine.

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
   - spec_decode: code edits (greedy, the answer re-types the file) beside sampled chat,
     n-gram speculation off vs on, at concurrency 1 and 8; edit TPOT mean at 1, chat TPOT
     mean at 8 beside it, and each class's acceptance;
   - disaggregation: chunked_prefill's traffic on one prefill and one decode worker vs the
     colocated chunked engine (the same interleaved matrix); the same key metric, TTFT
     beside it, the KV hand-off per request and the colocated run's phase contention;
3. one line per sub-run while it works (each bench's tables in its run directory's
   ``bench.txt``; ``verbose`` prints them, and each question's findings), then the answers;
4. write ``demo.json`` and one HTML report that opens with the answers, each with a chart
   of where the time went (``analyze.diagnosis.timesplit``).

Sizes are chosen so that each effect, where real, is several times its noise at the
sample size a 2-core CPU gets in the time: the full demo aims at under 10 minutes,
``--quick`` (CI) at a few. All servers start once and are stopped at the end.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from servelab.analyze.answers import (
    MAX_ITL,
    Answer,
    Question,
    answer,
    disagg_answer,
    spec_answer,
)
from servelab.analyze.compare import Comparison, compare
from servelab.analyze.diagnosis.diagnose import Diagnosis, diagnose
from servelab.analyze.diagnosis.timesplit import (
    TimeSplit,
    stall_split,
    step_split,
    token_split,
    ttft_split,
)
from servelab.bench.run import DEFAULT_MODEL, BenchOptions
from servelab.bench.workloads.request_plan import LoadSpec
from servelab.report.demo_report import write_demo_report
from servelab.report.terminal import render_answers, run_line
from servelab.rundir import Run, load_run
from servelab.workflows.matrix import (
    MatrixConfig,
    MatrixSpec,
    bench_logged,
    execute_matrix,
    has_records,
    record_server,
    start_servers,
)

# A 1 GB KV pool holds every load below and keeps the servers' memory modest.
KV = "--kv-cache-memory 1G"
CHUNKED = "--max-num-batched-tokens 256"
# Prompt lookup proposing up to 8 tokens (the engine adapts the length to what is accepted).
NGRAM = '{"method": "ngram", "num_speculative_tokens": 8}'
SERVERS = {
    # The default engine: a 256-token chunk budget is ~1/6 of a RAG prompt, so a prefill
    # shares steps with decodes instead of stalling them.
    "cached": f"{CHUNKED} {KV}",
    "uncached": f"{CHUNKED} --no-enable-prefix-caching {KV}",
    "unchunked": f"--no-enable-chunked-prefill {KV}",
    # Two sequences at most: a closed loop of six keeps four waiting, which is where a
    # priority acts (the scheduler admits by priority; it preempts only for KV blocks).
    "two-seqs": f"{CHUNKED} --max-num-seqs 2 {KV}",
    "ngram": f"{CHUNKED} --speculative-config '{NGRAM}' {KV}",
    # One prefill and one decode worker: on this machine's server core they time-share it,
    # the budget the colocated engine has (docs/disaggregation.md).
    "disagg": f"--disaggregated --prefill-workers 1 --decode-workers 1 {KV}",
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
    "spec_decode": Question(
        id="spec_decode",
        question="Speculative decoding: when does n-gram speculation pay, and what does it cost?",
        metric=("edit", "tpot", "mean"),
        cost=("chat", "tpot", "mean"),
        baseline="no speculation",
        treatment="n-gram, up to 8 drafts",
        treatment_effect="with n-gram",
        key_at="at concurrency 1",
        cost_at="at concurrency 8",
    ),
    "disaggregation": Question(
        id="disaggregation",
        question=(
            "Disaggregation: does splitting prefill and decode pay on this machine, and at what "
            "cost?"
        ),
        # Every chat stream, not chunked_prefill's population: split, a prompt's prefill
        # ends on another worker, often after the streams it overlapped have finished.
        metric=("chat", MAX_ITL, "mean"),
        cost=("overall", "ttft", "p50"),
        baseline="colocated, chunked",
        treatment="1 prefill + 1 decode worker",
        treatment_effect="split",
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


def spec_workload(scale: float) -> dict[str, Any]:
    """Q5: code edits answered greedily (the answer re-types much of a shared file, which
    prompt lookup predicts) beside open chat sampled at temperature 1 (little to predict);
    equal output lengths, so each class's TPOT compares like with like."""
    out = {"dist": "fixed", "value": round(128 * scale)}
    code_file = {"dist": "uniform", "min": round(192 * scale), "max": round(384 * scale)}
    return {
        "name": "demo-spec",
        "classes": [
            {
                "name": "edit",
                "text": "code",
                "input": {"dist": "uniform", "min": 16, "max": 32},
                "output": out,
                "prefix": [
                    {"name": "file", "count": 4, "tokens": code_file, "reuse": 1.0, "text": "code"}
                ],
                "temperature": 0.0,
            },
            {
                "name": "chat",
                "text": "question",
                "input": {"dist": "uniform", "min": 64, "max": 128},
                "output": out,
                "temperature": 1.0,
            },
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
    # spec_decode: (concurrency, requests) at the low load (the key) and the high (the cost)
    spec_loads: tuple[tuple[int, int], tuple[int, int]] = ((1, 16), (8, 32))


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
    budget="a few minutes",
    spec_loads=((1, 4), (4, 8)),
)


@dataclass
class DemoResult:
    out: Path
    report: Path | None
    answers: list[Answer]
    comparisons: dict[str, Comparison]
    groups: dict[str, list[list[Run]]]
    diagnoses: dict[str, Diagnosis]
    splits: dict[str, TimeSplit]
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


# (run directory, workload, [(config, server, workload override)], requests, concurrency):
# one interleaved matrix each, baseline first.
Plan = tuple[str, str, list[tuple[str, str, str | None]], int, int]
# Each question's configurations (the runs it compares), baseline first.
CONFIGS = {
    "rag_ttft": ["uncached", "cached"],
    "chunked_prefill": ["unchunked", "chunked"],
    "priorities": ["fcfs", "priority"],
    "spec_decode": ["off-c{lo}", "ngram-c{lo}", "off-c{hi}", "ngram-c{hi}"],
    "disaggregation": ["chunked", "disagg"],
}


def _plans(out: Path, size: DemoSize) -> list[Plan]:
    s = size.scale
    spec = _write_workload(out, spec_workload(s))
    plans: list[Plan] = [
        (
            "rag_ttft",
            _write_workload(out, rag_workload(s)),
            [("uncached", "uncached", None), ("cached", "cached", None)],
            size.requests["rag_ttft"],
            size.concurrency["rag_ttft"],
        ),
        (
            # disaggregation's runs share this matrix: its baseline is the chunked engine.
            "chunked_prefill",
            _write_workload(out, mixed_workload(s)),
            [("unchunked", "unchunked", None), ("chunked", "cached", None)]
            + [("disagg", "disagg", None)],
            size.requests["chunked_prefill"],
            size.concurrency["chunked_prefill"],
        ),
        (
            "priorities",
            _write_workload(out, priority_workload(s, 0)),
            [
                ("fcfs", "two-seqs", None),
                ("priority", "two-seqs", _write_workload(out, priority_workload(s, 1))),
            ],
            size.requests["priorities"],
            size.concurrency["priorities"],
        ),
    ]
    for conc, n in size.spec_loads:
        configs = [(f"off-c{conc}", "cached", None), (f"ngram-c{conc}", "ngram", None)]
        plans.append((f"spec_decode/c{conc}", spec, configs, n, conc))
    return plans


def run_demo(
    quick: bool = False,
    out: Path | None = None,
    console: Console | None = None,
    size: DemoSize | None = None,
    seed: int = 1,
    verbose: bool = False,
) -> DemoResult:
    """Run the whole demo (``size`` overrides FULL/QUICK); raises RuntimeError when a
    server cannot start. ``verbose`` prints every bench's tables and the findings."""
    console = console or Console()
    size = size or (QUICK if quick else FULL)
    out = out or Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-demo{'-quick' if quick else ''}"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    console.rule("[bold]servelab demo" + (" --quick" if quick else ""))
    console.print(
        "Six questions, each answered by one comparison: RAG TTFT and prefix caching, "
        "chunked prefill under mixed traffic, interactive vs batch priorities, what sets ITL, "
        f"speculative decoding, disaggregation; expect {size.budget}. Everything lands in {out}."
    )
    # Its own engines, at flags of its own: each command heads its server's log, and the
    # terminal keeps to the answers (and the warnings of servers a crash left running).
    servers = start_servers(
        SERVERS,
        out,
        console=console,
        announce=lambda line: (
            None if line.startswith("launching: ") else console.print(line, markup=False)
        ),
    )
    console.print(f"{len(servers)} engines ready in {time.monotonic() - t0:.0f} s")
    plans = _plans(out, size)
    code = _write_workload(out, codegen_workload(size.scale))
    total = sum(len(c) for _, _, c, _, _ in plans) * size.repeats + len(size.levels)
    runs: dict[str, list[Run]] = {}
    interrupted = False
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=verbose,
    )
    task = progress.add_task("sub-runs", total=total)

    def on_run(run_dir: Path, exit_code: int) -> None:
        run = load_run(run_dir) if has_records(run_dir) else None
        label = f"{run_dir.parent.relative_to(out)} {run_dir.name}"
        progress.console.print(run_line(label, run, exit_code))
        progress.advance(task)

    if not verbose:
        console.rule("one line per sub-run (its tables: bench.txt in its directory)")
    try:
        with progress:
            for where, workload, configs, n, conc in plans:
                if verbose:
                    console.rule(f"[bold]{where}")
                spec = MatrixSpec(
                    [MatrixConfig(c, SERVERS[k], w) for c, k, w in configs], size.repeats
                )
                res = execute_matrix(
                    spec,
                    _opts(out, where, workload, n, conc, seed),
                    console,
                    servers={c: servers[k] for c, k, _ in configs},
                    on_run=None if verbose else on_run,
                )
                ran = [c for c, paths in res.runs.items() if paths]  # res.groups' order
                runs.update(zip(ran, res.groups, strict=True))
                interrupted = INTERRUPTED in res.exit_codes.values()
                if interrupted:
                    break
            if not interrupted:
                if verbose:
                    console.rule("[bold]decode_itl")
                levels, interrupted = _levels(
                    out, code, size, servers, console, seed, None if verbose else on_run
                )
                runs.update(levels)
    finally:
        with console.status("stopping the engines ..."):
            for srv in servers.values():
                srv.stop()
    return _conclude(out, _groups(runs, size), interrupted, console, t0, seed, size, verbose)


def _groups(runs: dict[str, list[Run]], size: DemoSize) -> dict[str, list[list[Run]]]:
    """Each question's groups of runs, baseline first, for the questions whose runs all ran
    (decode_itl: the levels that ran, at least two)."""
    (lo, _), (hi, _) = size.spec_loads
    groups = {}
    for qid, names in CONFIGS.items():
        names = [n.format(lo=lo, hi=hi) for n in names]
        if all(n in runs for n in names):
            groups[qid] = [runs[n] for n in names]
    levels = [runs[f"c{c}"] for c in size.levels if f"c{c}" in runs]
    if len(levels) >= 2:
        groups["decode_itl"] = levels
    return {q: groups[q] for q in QUESTIONS if q in groups}


def _levels(
    out: Path,
    workload: str,
    size: DemoSize,
    servers: dict[str, Any],
    console: Console,
    seed: int,
    on_run: Callable[[Path, int], None] | None,
) -> tuple[dict[str, list[Run]], bool]:
    """decode_itl: one run per concurrency level on the default engine, lowest first."""
    runs: dict[str, list[Run]] = {}
    for c in size.levels:
        n = max(size.per_level * c, MIN_LEVEL_REQUESTS)
        opts = _opts(out / "decode_itl", f"c{c}", workload, n, c, seed)
        code = bench_logged(opts, console, on_run)
        run_dir = out / "decode_itl" / f"c{c}"
        if has_records(run_dir):
            record_server(run_dir, servers["cached"])
            runs[f"c{c}"] = [load_run(run_dir)]
        if on_run is not None:
            on_run(run_dir, code)
        if code == INTERRUPTED:
            return runs, True
    return runs, False


def _labels(gs: list[list[Run]]) -> list[str]:
    return [g[0].name.rsplit("-r", 1)[0] for g in gs]


def _answer(qid: str, gs: list[list[Run]], size: DemoSize, seed: int) -> Answer:
    q = QUESTIONS[qid]
    if qid == "spec_decode":
        (lo, _), (hi, _) = size.spec_loads
        q = replace(q, key_at=f"at concurrency {lo}", cost_at=f"at concurrency {hi}")
        return spec_answer(q, (gs[0], gs[1]), (gs[2], gs[3]), seed=seed)
    if qid == "disaggregation":
        return disagg_answer(q, gs[0], gs[1], seed=seed)
    levels = None
    if qid == "decode_itl":  # the levels run (--quick stops at 4, an interrupt earlier)
        levels = (size.levels[0], size.levels[len(gs) - 1])
        q = replace(
            q,
            baseline=f"concurrency {levels[0]}",
            treatment=f"concurrency {levels[1]}",
            treatment_effect=f"at concurrency {levels[1]}",
        )
    return answer(q, gs[0], gs[-1], seed=seed, levels=levels)


def _split(qid: str, gs: list[list[Run]]) -> TimeSplit:
    """Where the time went, for the question's card (``analyze.diagnosis.timesplit``)."""
    q = QUESTIONS[qid]
    named = list(zip(_labels(gs), gs, strict=True))
    if qid == "decode_itl":
        return step_split(named)
    if qid == "spec_decode":
        edit, chat = q.metric[0], q.cost[0]
        return token_split(named, [edit, edit, chat, chat])
    if q.metric[1] == MAX_ITL:
        return stall_split(named, q.metric[0], q.during)
    return ttft_split(named, q.metric[0])


def _conclude(
    out: Path,
    groups: dict[str, list[list[Run]]],
    interrupted: bool,
    console: Console,
    t0: float,
    seed: int,
    size: DemoSize,
    verbose: bool,
) -> DemoResult:
    answers: list[Answer] = []
    comparisons: dict[str, Comparison] = {}
    diagnoses: dict[str, Diagnosis] = {}
    splits: dict[str, TimeSplit] = {}
    with console.status("comparing and diagnosing ..."):
        for qid, gs in groups.items():
            comparisons[qid] = compare(gs, _labels(gs), seed=seed)
            answers.append(_answer(qid, gs, size, seed))
            splits[qid] = _split(qid, gs)
            # The treatment's first run is the one a reader opens to see why.
            diagnoses[qid] = diagnose(gs[1 if qid == "spec_decode" else -1][0])
    if verbose:
        console.rule("findings")
        for qid, d in diagnoses.items():
            console.print(f"[bold]{qid}[/] ({groups[qid][-1][0].name}):")
            if not d.findings:
                console.print("  [green]no findings[/]")
            for f in d.findings:
                console.print(
                    f"  [yellow]> {f.title}[/] [dim]({f.confidence_label})[/]: {f.summary}"
                )
    wall = time.monotonic() - t0
    (out / "demo.json").write_text(
        json.dumps(
            {
                "questions": [
                    a.to_dict() | {"where_the_time_went": splits[a.question.id].to_dict()}
                    for a in answers
                ],
                "wall_s": wall,
                "seed": seed,
            },
            indent=1,
            default=str,
        )
    )
    report = None
    if answers:
        with console.status("writing the report ..."):
            report = write_demo_report(
                answers, comparisons, groups, diagnoses, splits, out / "report.html", wall
            )
    render_answers(answers, console)
    if interrupted:
        console.print("[yellow]interrupted: the answers cover what ran[/]")
    if report is not None:
        console.print(f"[bold]report: {report.resolve()}[/]")
    console.print(f"demo.json and the run directories: {out.resolve()} ({wall:.0f} s in all)")
    return DemoResult(
        out, report, answers, comparisons, groups, diagnoses, splits, wall, interrupted
    )
