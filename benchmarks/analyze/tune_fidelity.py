"""`servelab tune` against reality: does the replay match the run, and does the chosen
setting do, when run for real, what was predicted?

    .venv/bin/python -m benchmarks.analyze.tune_fidelity [--cases NAME,...] [--duration 120]
        [--repeats 2] [--seeds 5] [--out runs/tune-fidelity-<time>] [--reuse DIR] [--no-verify]

Cases (``--cases``, default all but the two demo ones; ``--list`` prints them): RAG with
shared prefixes, RAG with unique prompts, chat, mixed chat+RAG, long-output codegen, bursty
arrivals, a multi-turn replay of recorded conversations (ShareGPT), and the demo's two
mixed-traffic runs (unchunked, and chunked at 256 tokens). For each:

1. ``servelab bench`` runs the case for real on the embedded engine (default model) ->
   ``CASE/run``. The benchmark never tunes anything against these runs.
2. ``servelab tune CASE/run --json --verify`` replays it, self-checks the replay, predicts
   the findings' candidates, decides, and reruns the same planned requests with the chosen
   setting and as run (``--repeats`` each, alternating) -> ``CASE/tune.json``,
   ``CASE/verify/``.
3. Prints per case: the findings, the self-check (figures within the tolerance of 15%, the
   worst error), the time to predict every candidate, the chosen setting, its key figure
   predicted vs measured, and the verified verdict (permutation test, alpha 0.05); then the
   totals against the targets: every replay within 15%; the key-figure prediction within
   20% of its verified measurement in at least 5 of 6 cases; where a finding fired, the
   verified setting better than as run, significantly, in at least 5 of 6; prediction under
   30 s for a 2-minute run. Writes ``tune_fidelity.json``.

``--reuse DIR`` takes the as-run runs of an earlier ``--out`` and redoes step 2 (with
``--no-verify``, only the replay and the predictions: a few seconds per case).

RAG with unique prompts runs 240 s whatever ``--duration`` says: at 0.2 requests/s a 90 s
run held 13 requests, and its longest-ITL mean moved 40% between two runs of one config.

Time: each case is one run of ``--duration`` seconds plus its drain, the prediction
(seconds), and ``2 x --repeats`` verify runs of about the same length plus the servers'
start: about 10 minutes per case at the defaults, 80-90 minutes for all of them on the
2-core machine. Run it on a quiet machine: other work on the cores shifts the step times
between the run and its verification.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from servelab.workflows.demo import mixed_workload

SERVELAB = [sys.executable, "-m", "servelab.cli"]
INVALID_RUN = 3  # `servelab bench`: finished, but the client could not keep its timing
REPLAY_TOLERANCE = 0.15
KEY_TOLERANCE = 0.20
PREDICT_BUDGET_S = 30.0

# A RAG class whose prompts share nothing (each a unique question over its own text).
RAG_UNIQUE = {
    "name": "rag-unique",
    "classes": [
        {
            "name": "rag",
            "text": "question",
            "input": {"dist": "uniform", "min": 600, "max": 900},
            "output": {"dist": "uniform", "min": 16, "max": 64},
            "slo": {"ttft": "6s", "itl": "500ms"},
        }
    ],
}
# the demo's own mixed traffic: two short chats per long unique RAG prompt
WORKLOAD_FILES = {"rag-unique": RAG_UNIQUE, "demo-mixed": mixed_workload(1.0)}


@dataclass(frozen=True)
class Case:
    name: str
    what: str
    args: tuple[str, ...]  # `servelab bench` load and workload flags
    timed: bool = True  # open loop for --duration (False: a fixed closed loop)
    # seconds of sends where --duration would hold too few requests to judge a percentile
    duration: float | None = None


CASES = (
    Case("rag-shared", "RAG, shared system prompt and documents", ("--workload", "rag", "--rate", "0.25")),
    Case("rag-unique", "RAG, unique 600-900-token prompts", ("--workload", "@rag-unique", "--rate", "0.2"), duration=240),
    Case("chat", "chat sessions of 1-3 turns", ("--workload", "chat", "--rate", "0.4")),
    Case("mixed", "chat and RAG mixed (the demo's traffic, open loop)", ("--workload", "@demo-mixed", "--rate", "0.5")),
    Case("codegen", "code prompts, long outputs", ("--workload", "codegen", "--rate", "0.1")),
    Case("bursty", "chat, gamma arrivals (CV 2.2)", ("--workload", "chat", "--rate", "0.4", "--arrival", "gamma", "--burstiness", "0.2")),
    Case(
        "multiturn",
        "recorded ShareGPT conversations replayed turn by turn",
        ("--dataset", "sharegpt", "--conversation", "multi-turn", "--endpoint", "chat",
         "--max-input-len", "1024", "--rate", "0.1"),
    ),
    Case(
        "demo-unchunked",
        "the demo's mixed run, chunked prefill off",
        ("--workload", "@demo-mixed", "--concurrency", "6", "--requests", "18", "--seed", "1",
         "--engine-args", "--no-enable-chunked-prefill --kv-cache-memory 1G"),
        timed=False,
    ),
    Case(
        "demo-chunked",
        "the demo's mixed run, 256-token chunks",
        ("--workload", "@demo-mixed", "--concurrency", "6", "--requests", "18", "--seed", "1",
         "--engine-args", "--max-num-batched-tokens 256 --kv-cache-memory 1G"),
        timed=False,
    ),
)  # fmt: skip
DEFAULT_CASES = [c.name for c in CASES if not c.name.startswith("demo-")]


def run(cmd: list[str], quiet: bool = True) -> int:
    print("$", " ".join(cmd[2:] if cmd[:2] == SERVELAB[:2] else cmd), flush=True)
    out = subprocess.DEVNULL if quiet else None
    code = subprocess.run(cmd, check=False, stdout=out).returncode
    if code == INVALID_RUN:
        print("  (the benchmark marked this run invalid: client timing; kept)", flush=True)
    elif code != 0:
        raise SystemExit(f"command failed with exit status {code}: {' '.join(cmd)}")
    return code


def bench_args(case: Case, out: Path, duration: float) -> list[str]:
    args = []
    for a in case.args:
        if a.startswith("@"):
            path = out / "workloads" / f"{a[1:]}.yaml"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(yaml.safe_dump(WORKLOAD_FILES[a[1:]], sort_keys=False))
            a = str(path)
        args.append(a)
    if case.timed:
        args += ["--duration", f"{case.duration or duration:g}s"]
    return args


def summarize_case(case: Case, doc: dict[str, Any]) -> dict[str, Any]:
    """The figures the targets are judged on, from `servelab tune --json`."""
    check = doc.get("self_check") or {}
    rows = check.get("rows") or []
    errs = [abs(r["error"]) for r in rows if r.get("error") is not None]
    within = sum(e <= REPLAY_TOLERANCE for e in errs)
    decision = doc.get("decision") or {}
    chosen = decision.get("chosen")
    v = doc.get("verification") or {}
    key = ((v.get("arms") or [{}])[0]).get("key") or {}  # the top-1's key figure
    tuned = {(r["scope"], r["figure"]): r for r in v.get("rows") or [] if r["config"] == "tuned"}
    t = doc.get("timings_s") or {}
    return {
        "case": case.name,
        "what": case.what,
        "findings": [f["id"] for f in doc.get("findings", [])],
        "refused": doc.get("refused"),
        "replay_figures": len(errs),
        "replay_within_15pct": within,
        "replay_worst_error": max(errs) if errs else None,
        "replay_strayed": check.get("strayed"),
        "replay_thin": [f"{r['scope']} {r['figure']}" for r in rows if r["verdict"] == "thin"],
        "self_check_ok": check.get("ok"),
        "predict_s": t.get("total_s"),
        "candidates": len(doc.get("candidates") or []),
        "chosen": chosen["candidate"]["title"] if chosen else None,
        "chosen_reason": chosen["reason"] if chosen else None,
        "key_figure": [key.get("scope"), key.get("figure")] if key else None,
        "key_predicted_error": (tuned.get((key.get("scope"), key.get("figure"))) or {}).get(
            "error"
        ),
        "key_predicted_error_adjusted": key.get("error"),
        "verified": v.get("verdict"),
        "verified_p": key.get("p_value"),
        "verified_sentence": v.get("sentence"),
        "verify_s": t.get("verify_s"),
        "verify_estimate_s": t.get("verify_estimate_s"),
    }


def _fmt(x: Any, pct: bool = False) -> str:
    if x is None:
        return "-"
    if pct:
        return f"{x:+.1%}" if x < 0 else f"{x:.1%}"
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    print()
    for r in rows:
        print(f"== {r['case']}: {r['what']}")
        print(f"   findings: {', '.join(r['findings']) or 'none'}")
        if r["refused"]:
            print(f"   NO PREDICTION: {r['refused']}")
        print(
            f"   replay: {r['replay_within_15pct']}/{r['replay_figures']} figures within 15%, "
            f"worst {_fmt(r['replay_worst_error'], True)}; self-check "
            f"{'passed' if r['self_check_ok'] else 'FAILED'}; predicted {r['candidates']} "
            f"candidates in {_fmt(r['predict_s'])} s"
        )
        if r["replay_thin"]:
            print(f"   thin (not pinned down by the run): {', '.join(r['replay_thin'])}")
        print(f"   chosen: {r['chosen'] or '-'} ({r['chosen_reason'] or 'nothing pays'})")
        if r["verified"]:
            print(
                f"   verified: {r['verified']} (p {_fmt(r['verified_p'])}); key figure "
                f"{r['key_figure']} predicted {_fmt(r['key_predicted_error'], True)} from the "
                f"measurement ({_fmt(r['key_predicted_error_adjusted'], True)} as a change from "
                f"the as-run arm); verify took {_fmt(r['verify_s'])} s (stated "
                f"{_fmt(r['verify_estimate_s'])} s)"
            )
            print(f"   {r['verified_sentence']}")
    replayed = [r for r in rows if r["replay_figures"]]
    keyed = [r for r in rows if r["key_predicted_error"] is not None]
    fired = [r for r in rows if r["findings"] and r["verified"]]
    totals = {
        "replays_within_15pct": sum(
            r["replay_within_15pct"] == r["replay_figures"] for r in replayed
        ),
        "replays": len(replayed),
        "self_checks_passed": sum(bool(r["self_check_ok"]) for r in replayed),
        "key_within_20pct": sum(abs(r["key_predicted_error"]) <= KEY_TOLERANCE for r in keyed),
        "key_change_within_20pct": sum(
            abs(r["key_predicted_error_adjusted"] or 1e9) <= KEY_TOLERANCE for r in keyed
        ),
        "keyed": len(keyed),
        "verified_better": sum(r["verified"] == "better" for r in fired),
        "verified_where_fired": len(fired),
        "predict_under_30s": sum((r["predict_s"] or 1e9) < PREDICT_BUDGET_S for r in rows),
        "cases": len(rows),
    }
    print()
    print(
        f"replay within 15% on every figure: {totals['replays_within_15pct']} of "
        f"{totals['replays']} cases; self-check passed (no figure strayed beyond 15% and the "
        f"run's own interval): {totals['self_checks_passed']} of {totals['replays']}\n"
        f"key-figure prediction within 20% of the verified measurement: "
        f"{totals['key_within_20pct']} of {totals['keyed']} (target: 5 of 6); as a change "
        f"from the as-run arm: {totals['key_change_within_20pct']} of {totals['keyed']}\n"
        f"verified better than as run, significant, where a finding fired: "
        f"{totals['verified_better']} of {totals['verified_where_fired']} (target: 5 of 6)\n"
        f"all candidates predicted in under {PREDICT_BUDGET_S:.0f} s: "
        f"{totals['predict_under_30s']} of {totals['cases']}"
    )
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES))
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of sends per run")
    ap.add_argument("--repeats", type=int, default=2, help="verify runs per config")
    ap.add_argument("--seeds", type=int, default=5, help="simulator seeds per candidate")
    ap.add_argument("--out", default=f"runs/tune-fidelity-{time.strftime('%Y%m%d-%H%M%S')}")
    ap.add_argument("--reuse", metavar="DIR", help="the as-run runs of an earlier --out")
    ap.add_argument("--no-verify", action="store_true", help="replay and predict only")
    a = ap.parse_args()
    if a.list:
        for c in CASES:
            print(f"{c.name:15} {c.what}: {' '.join(c.args)}")
        return
    by_name = {c.name: c for c in CASES}
    unknown = [n for n in a.cases.split(",") if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; see --list")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    failed: list[dict[str, str]] = []

    def write(totals: dict[str, Any] | None) -> None:
        doc = {"cases": rows, "failed": failed, "totals": totals,
               "wall_s": time.perf_counter() - t0, "args": vars(a)}  # fmt: skip
        (out / "tune_fidelity.json").write_text(json.dumps(doc, indent=1))

    for name in a.cases.split(","):
        # A case that fails is recorded and the others still run; the file is rewritten
        # after every case, so a stopped benchmark keeps what finished.
        try:
            rows.append(fidelity_case(by_name[name], a, out))
        except SystemExit as e:
            print(f"   case {name} FAILED: {e}", flush=True)
            failed.append({"case": name, "error": str(e)})
        write(None)
    totals = report(rows)
    if failed:
        print(f"failed cases: {', '.join(f['case'] for f in failed)}")
    write(totals)
    print(f"wrote {out / 'tune_fidelity.json'} ({(time.perf_counter() - t0) / 60:.1f} min)")


def fidelity_case(case: Case, a: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Bench ``case`` (or take its run from ``--reuse``), tune it, and summarize; raises
    SystemExit when a command fails."""
    d = out / case.name
    run_dir = Path(a.reuse) / case.name / "run" if a.reuse else d / "run"
    if not a.reuse:
        run([*SERVELAB, "bench", *bench_args(case, out, a.duration), "--out", str(run_dir),
             "--quiet"])  # fmt: skip
    elif not (run_dir / "requests.jsonl").is_file():
        raise SystemExit(f"--reuse: no run at {run_dir}")
    d.mkdir(parents=True, exist_ok=True)
    cmd = [*SERVELAB, "tune", str(run_dir), "--json", "--seeds", str(a.seeds)]
    if not a.no_verify:
        cmd += ["--verify", "--repeats", str(a.repeats), "--out", str(d / "verify")]
    print("$", " ".join(cmd[2:]), flush=True)
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"servelab tune failed ({proc.returncode}): {proc.stderr[-2000:]}")
    # The JSON document is the last thing printed; a run's own warnings may come first.
    text = proc.stdout[proc.stdout.rfind("\n{\n") + 1 :] if "\n{\n" in proc.stdout else proc.stdout
    (d / "tune.json").write_text(text)
    return summarize_case(case, json.loads(text))


if __name__ == "__main__":
    main()
