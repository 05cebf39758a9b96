"""A twin of a live server checked against it: calibrate on one run, predict held-out runs, run them.

The parts the live-server benchmarks share (``twin_vllm``, ``twin_llamacpp``): a ``Peer``
says how to launch the server (a ``bench.servers.template`` command template), how the run states
its command to ``servelab bench``/``calibrate``, and how each measured run starts from a
cold prefix cache (an endpoint that empties it, or a server of its own). ``check`` runs the
training case on two launches of the server (one, if asked), calibrates on them, and for
each held-out case predicts it (``servelab sim
--calibration --seeds N``, the case's flags as the server spells them) and
runs it for real; it prints and writes (``results.json``) predicted (median and range over
the seeds) against measured TTFT p50/p90, ITL p50/p99, TPOT p50 and output tok/s: the
share within ``tolerance`` and the share inside the predicted range, per case and overall,
the training case's own replay listed apart (in-sample); and on the held-out cases each
stated interval's coverage and median width (``coverage``: the range over seeds, and the 80%
and 95% intervals a twin of several runs derives from its leave-one-run-out error). The
server runs on CPU 1, the client on CPU 0. ``python benchmarks/sim/twin_check.py coverage
PRED_DIR:RUN_DIR ...`` reports that coverage for any predictions and the runs they predicted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from servelab.bench.servers.template import TemplateServer
from servelab.sim.intervals import FIGURES

SERVELAB = [sys.executable, "-m", "servelab.cli"]
LENGTH_SCALE = "0.5"


@dataclass(frozen=True)
class Case:
    """One run: a workload preset, its load flags (``servelab bench``'s), the server's flags."""

    name: str
    workload: str
    load: str
    flags: str = ""
    train: bool = False

    @property
    def slug(self) -> str:
        return self.name.replace(" ", "-").replace("/", "")


@dataclass(frozen=True)
class Peer:
    """A server under test. ``template``: its launch command template (``{model}``,
    ``{host}``, ``{port}``, ``{flags}``); ``stated``: the command as the run states it,
    flags appended; ``model``/``tokenizer``: what it serves and how prompts are counted;
    ``reset``: empties its prefix cache at a URL, or None to start a server per measured
    run; ``warm_up``: readies a fresh server (first batches are not the server predicted)."""

    name: str
    template: str
    stated: str
    model: str
    tokenizer: str
    reset: Callable[[str], None] | None
    warm_up: Callable[[str, Case, Path, Path], float]  # (url, case, run dir, logs) -> s


def add_check_arguments(ap: argparse.ArgumentParser, health_timeout: float) -> None:
    """The options every live twin check takes (``check``'s parameters)."""
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument(
        "--train-runs",
        type=int,
        default=2,
        choices=(1, 2),
        help="training runs, each on its own launch",
    )
    ap.add_argument("--tolerance", type=float, default=0.2)
    ap.add_argument("--health-timeout", type=float, default=health_timeout)
    ap.add_argument(
        "--reuse", action="store_true", help="calibrate and predict again on --out's real runs"
    )


def training(case: Case, runs: int) -> list[Case]:
    """The training case, and with ``runs`` 2 the same again on a relaunched server."""
    again = Case(f"{case.name} relaunched", case.workload, case.load, case.flags, train=True)
    return [case, again][:runs]


def run(cmd: list[str], log: Path) -> float:
    """Run ``cmd``, its output to ``log``; returns seconds. Raises on failure."""
    t0 = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if code not in (0, 3):  # 3: complete, the client marked invalid on a loaded machine
        raise RuntimeError(f"`{shlex.join(cmd)}` exited {code}: see {log}")
    return time.perf_counter() - t0


def bench(peer: Peer, case: Case, url: str, out: Path, logs: Path) -> float:
    cmd = [
        "taskset", "-c", "0", *SERVELAB, "bench", "--url", url, "--tokenizer", peer.tokenizer,
        "--workload", case.workload, "--length-scale", LENGTH_SCALE, *shlex.split(case.load),
        "--server-config", f"{peer.stated} {case.flags}".strip(), "--out", str(out),
        "--quiet", "--seed", "1",
    ]  # fmt: skip
    return run(cmd, logs / f"bench-{out.name}.log")


def predict(case: Case, cal_path: Path, seeds: int, out: Path, logs: Path) -> float:
    eng = case.flags  # the server's own flags: `sim --calibration` reads them as it does
    cmd = [
        *SERVELAB, "sim", "--calibration", str(cal_path), "--workload", case.workload,
        "--length-scale", LENGTH_SCALE, *shlex.split(case.load), "--seed", "1",
        "--seeds", str(seeds), "--out", str(out), *(["--engine-args", eng] if eng else []),
    ]  # fmt: skip
    return run(cmd, logs / f"sim-{out.name}.log")


def measured(run_dir: Path) -> dict[str, float | None]:
    o = json.loads((run_dir / "metrics.json").read_text())["overall"]
    out: dict[str, float | None] = {}
    for name, metric, pct in FIGURES:
        out[name] = (
            o["throughput"]["output_tokens_per_s"] if metric is None else o["latency"][metric][pct]
        )
    return out


def compare(pred_dir: Path, run_dir: Path, tolerance: float) -> list[dict]:
    pred = json.loads((pred_dir / "prediction.json").read_text())["figures"]
    real = measured(run_dir)
    rows = []
    for name, _, _ in FIGURES:
        p, m = pred[name]["median"], real[name]
        lo, hi = pred[name]["interval"] or (None, None)
        err = (p - m) / m if p is not None and m else None
        rows.append(
            {
                "figure": name,
                "predicted": p,
                "range": [lo, hi],
                "measured": m,
                "error": err,
                "within": err is not None and abs(err) <= tolerance,
                "covered": m is not None and lo is not None and lo <= m <= hi,
                "intervals": pred[name].get("intervals") or {},
            }
        )
    return rows


def coverage(pairs: list[tuple[Path, Path]]) -> dict[str, dict[str, float | int | None]]:
    """How the stated intervals did on held-out runs: for each (prediction directory of
    ``sim --seeds``, the measured run directory it predicted) pair and every figure, whether
    the measured figure fell inside the range over seeds and inside each level's interval
    the twin stated (80%, 95%). Per interval: figures judged, the share covered and the
    median width relative to the median prediction."""
    import statistics

    seen: dict[str, list[tuple[bool, float]]] = {}
    for pred_dir, run_dir in pairs:
        for row in compare(pred_dir, run_dir, 0.0):
            m, p = row["measured"], row["predicted"]
            if m is None or not p:
                continue
            spans = {"seeds range": row["range"], **row["intervals"]}
            for level, (lo, hi) in spans.items():
                if lo is not None:
                    seen.setdefault(level, []).append((lo <= m <= hi, (hi - lo) / p))
    return {
        level: {
            "figures": len(v),
            "coverage": sum(c for c, _ in v) / len(v),
            "median_width": statistics.median(w for _, w in v),
        }
        for level, v in seen.items()
    }


def main(argv: list[str] | None = None) -> None:
    """``twin_check.py coverage PRED_DIR:RUN_DIR ...``: the coverage and width report."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    cov = sub.add_parser("coverage", help="intervals' coverage on held-out runs")
    cov.add_argument("pairs", nargs="+", help="PRED_DIR:RUN_DIR (a sim --seeds run, the real run)")
    args = ap.parse_args(argv)
    pairs = []
    for text in args.pairs:
        pred, sep, real = text.partition(":")
        if not sep or not (Path(pred) / "prediction.json").is_file():
            ap.error(f"{text!r}: write PRED_DIR:RUN_DIR, PRED_DIR holding prediction.json")
        if not (Path(real) / "metrics.json").is_file():
            ap.error(f"{text!r}: {real} holds no metrics.json")
        pairs.append((Path(pred), Path(real)))
    report = coverage(pairs)
    print("| interval | figures | coverage | median width |")
    print("|---|---|---|---|")
    for level, r in report.items():
        print(f"| {level} | {r['figures']} | {r['coverage']:.0%} | {r['median_width']:.0%} |")
    print(json.dumps(report))


if __name__ == "__main__":
    main()


def _fmt(name: str, v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1e3:.1f}" if name != "output_tok_s" else f"{v:.1f}"


def render(results: list[dict]) -> str:
    lines = [
        "| case | figure | predicted | range over seeds | measured | error | in range |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for row in r["rows"]:
            n = row["figure"]
            lo, hi = row["range"]
            err = "-" if row["error"] is None else f"{row['error']:+.0%}"
            lines.append(
                f"| {r['case']} | {n}{' (ms)' if n != 'output_tok_s' else ''} | "
                f"{_fmt(n, row['predicted'])} | {_fmt(n, lo)}-{_fmt(n, hi)} | "
                f"{_fmt(n, row['measured'])} | {err} | {'yes' if row['covered'] else 'no'} |"
            )
    return "\n".join(lines)


def score(results: list[dict]) -> dict:
    rows = [row for r in results if not r["train"] for row in r["rows"] if row["error"] is not None]
    cases = [r for r in results if not r["train"]]
    return {
        "figures": len(rows),
        "within_tolerance": sum(r["within"] for r in rows),
        "covered": sum(r["covered"] for r in rows),
        "cases_mostly_covered": sum(
            sum(row["covered"] for row in r["rows"]) > len(r["rows"]) / 2 for r in cases
        ),
        "cases": len(cases),
    }


def check(
    peer: Peer,
    train: list[Case],
    held: list[Case],
    out: Path,
    seeds: int = 8,
    tolerance: float = 0.2,
    health_timeout: float = 900.0,
    reuse: bool = False,
    timings: dict[str, float] | None = None,
) -> dict:
    """Run, calibrate, predict and compare (the module doc). ``train``: the training runs,
    each on a server launched for it, first (the twin is fitted to them all, so that its
    ranges carry how far a relaunched server's speed moves); ``reuse``: calibrate and
    predict again on the real runs already in ``out``. Returns what ``results.json`` holds."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    timings = {} if timings is None else timings
    cal_path = out / "twin.json"
    results: list[dict] = []

    def evaluate(case: Case) -> None:
        real = out / f"real-{case.slug}"
        pred = out / f"sim-{case.slug}"
        shutil.rmtree(pred, ignore_errors=True)  # reuse predicts again
        timings[f"predict {case.name}"] = predict(case, cal_path, seeds, pred, logs)
        results.append(
            {
                "case": case.name + (" (in-sample)" if case.train else ""),
                "train": case.train,
                "flags": case.flags,
                "rows": compare(pred, real, tolerance),
            }
        )

    # A server for each training run, then one per other set of flags (the held-out cases
    # with the training flags on the last training run's); with no cache reset, one server
    # per measured run.
    groups: list[list[Case]] = []
    for c in [*train, *held]:
        same = next((g for g in reversed(groups) if g[0].flags == c.flags), None)
        if same is not None and peer.reset is not None and not c.train:
            same.append(c)
        else:
            groups.append([c])
    for cases in [] if reuse else groups:
        t0 = time.perf_counter()
        flags = cases[0].flags
        name = flags.strip("-").replace(" ", "_") or "default"
        label = name if peer.reset is not None and not cases[0].train else cases[0].slug
        server = TemplateServer(peer.template, logs / f"{peer.name}-{label}.log", peer.model, flags)
        try:
            asyncio.run(server.wait_healthy(timeout=health_timeout))
            timings[f"start {peer.name} {label}"] = time.perf_counter() - t0
            warm_dir = out / f"warmup-{label}"
            timings[f"warm-up {label}"] = peer.warm_up(server.url, cases[0], warm_dir, logs)
            for case in cases:
                if peer.reset is not None:
                    # The warm-up and the earlier cases sent the same sessions (seed 1):
                    # without this, the first turns hit blocks a cold twin never has.
                    peer.reset(server.url)
                real = out / f"real-{case.slug}"
                timings[f"bench {case.name}"] = bench(peer, case, server.url, real, logs)
        finally:
            server.stop()
    t1 = time.perf_counter()
    trained = [c for c in train if (out / f"real-{c.slug}").is_dir()]
    run([*SERVELAB, "calibrate", *(str(out / f"real-{c.slug}") for c in trained),
         "--hardware", "cpu", "--server-config", f"{peer.stated} {train[0].flags}".strip(),
         "--out", str(cal_path)], logs / "calibrate.log")  # fmt: skip
    timings["calibrate"] = time.perf_counter() - t1
    for case in [*trained, *held]:
        if (out / f"real-{case.slug}").is_dir():
            evaluate(case)
    timings["total_s"] = time.perf_counter() - t_start
    summary = score(results)
    held_pairs = [(out / f"sim-{c.slug}", out / f"real-{c.slug}") for c in held]
    summary["intervals"] = coverage([(p, r) for p, r in held_pairs if r.is_dir()])
    doc = {"results": results, "score": summary, "timings": timings}
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    print(render(results))
    print(json.dumps(summary))
    print("timings (s):", json.dumps({k: round(v, 1) for k, v in timings.items()}))
    return doc
