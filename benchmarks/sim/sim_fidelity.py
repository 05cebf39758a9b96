"""Simulator fidelity on this machine: profile on some workloads, predict held-out ones,
and run those for real in the same session.

    python -m benchmarks.sim.sim_fidelity [--rate 0.3] [--requests 12] [--source runs|grid]
        [--train chat,codegen,agent] [--heldout "rag;rag --max-num-batched-tokens 256;agent@0.45"]
        [--sim-seeds 5] [--rounds 2] [--reuse runs/fidelity-...]

1. ``servelab bench`` runs every case for real (the embedded server, the default model):
   the training workloads and the held-out cases -- a workload the profile never saw, or
   a seen one at another rate or with other engine args (``WORKLOAD[@RATE][ ENGINE
   ARGS]``, cases separated by ``;``). It runs them in ``--rounds`` rounds, training and
   held-out cases alternating within each, so that the machine's drift over minutes falls
   on both alike.
2. ``servelab profile --from-run`` turns the training runs' steps into a profile table
   (``--source grid`` profiles the batch-shape grid instead). It prices each shape at the
   training runs' typical speed, which is the held-out runs' typical speed too when both
   span the same minutes.
3. ``servelab sim --profile`` simulates each held-out case with the same load and seed,
   once per ``--sim-seed`` in ``0..sim_seeds-1`` (the simulator draws step noise and
   resent-history divergence; one draw is as random as the real run itself).
4. Prints, per held-out case, the relative error of the simulated p50/p95 TTFT, ITL
   and E2E and of the output throughput against the mean of the real repeats (targets:
   10% on the percentiles, 5% on throughput): the error of the median over the sim seeds,
   and the range of the single seeds' errors, which shows how far one draw strays. Beside
   them: the 95% bootstrap interval of one real run's figure (from its ``metrics.json``,
   averaged over the repeats), which says how well 12 requests pin a percentile down; how
   far the real repeats are from their mean ("real vs real": the same load on the same
   machine minutes apart, the floor under any prediction); and an in-sample control: the
   same runs simulated on a profile of their own steps, which separates what the simulator
   gets wrong from how much the machine's speed drifted between runs. Writes
   ``fidelity.json``.

Training covers the contexts the held-out cases reach: a profile made of short-context
runs alone under-predicts the decode steps of longer contexts (profile coverage, not the
simulator; docs/notes/sim-fidelity-log.md has the figures).

``--reuse DIR`` takes the real runs from an earlier output directory (as many rounds as it
holds, up to ``--rounds``) and redoes only the profiles and simulations (about a
minute): for working on the simulator against fixed real runs.

Real runs on a 2-core machine shared with other work are slow and noisy: keep the rate
and request counts small, and quote the figures as provisional.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

SERVELAB = [sys.executable, "-m", "servelab.cli"]
METRICS = [
    ("ttft", "p50"),
    ("ttft", "p95"),
    ("itl", "p50"),
    ("itl", "p95"),
    ("e2e", "p50"),
    ("e2e", "p95"),
]


INVALID_RUN = 3  # `servelab bench`: finished, but the client could not keep its timing


def run(cmd: list[str], quiet: bool = False) -> None:
    print("$", " ".join(cmd[2:] if cmd[:2] == SERVELAB[:2] else cmd), flush=True)
    code = subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL if quiet else None).returncode
    if code == INVALID_RUN:
        print(
            "  (the benchmark marked this run invalid: the machine was too busy for exact "
            "client timing; its figures are kept but less trustworthy)",
            flush=True,
        )
    elif code != 0:
        raise SystemExit(f"command failed with exit status {code}: {' '.join(cmd)}")


@dataclass(frozen=True)
class Case:
    """One load: a workload at a rate, with extra engine args for the server and the sim."""

    workload: str
    rate: float
    engine_args: str = ""

    @property
    def name(self) -> str:
        tail = re.sub(r"[^A-Za-z0-9]+", "-", self.engine_args).strip("-")
        return "-".join(x for x in (self.workload, f"r{self.rate:g}", tail) if x)

    @property
    def label(self) -> str:
        return " ".join(x for x in (f"{self.workload}@{self.rate:g}", self.engine_args) if x)


def parse_cases(text: str, rate: float, sep: str) -> list[Case]:
    """``WORKLOAD[@RATE][ ENGINE ARGS]`` items separated by ``sep``; RATE defaults to
    ``rate``."""
    cases = []
    for item in (x.strip() for x in text.split(sep)):
        if not item:
            continue
        head, _, engine_args = item.partition(" ")
        workload, _, r = head.partition("@")
        cases.append(Case(workload, float(r) if r else rate, engine_args.strip()))
    return cases


def load_args(a: argparse.Namespace, case: Case) -> list[str]:
    args = [
        "--workload",
        case.workload,
        "--rate",
        str(case.rate),
        "--requests",
        str(a.requests),
        "--seed",
        str(a.seed),
        "--length-scale",
        str(a.length_scale),
    ]
    return args + (["--engine-args", case.engine_args] if case.engine_args else [])


def rel_error(sim: float, real: float) -> float | None:
    return (sim - real) / real if real else None


def overall(run_dir: Path) -> dict:
    """The run's whole-run metrics (``metrics.json``'s ``overall``)."""
    return json.loads((run_dir / "metrics.json").read_text())["overall"]


def figures(m: dict) -> dict[str, float]:
    out = {f"{k}_{p}": m["latency"][k][p] for k, p in METRICS}
    out["output_tok_s"] = m["throughput"]["output_tokens_per_s"]
    return out


def relative_cis(m: dict) -> dict[str, tuple[float, float]]:
    """The 95% bootstrap interval of each percentile (whole requests resampled), relative
    to the percentile: how well one run pins the figure down."""
    lat = m["latency"]
    out = {}
    for k, p in METRICS:
        value, ci = lat[k][p], lat[k].get("ci", {}).get(p)
        if value and ci:
            out[f"{k}_{p}"] = (ci[0] / value - 1, ci[1] / value - 1)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--train", default="chat,codegen,agent", help="loads to profile on (comma-separated)"
    )
    ap.add_argument(
        "--heldout",
        default="rag;rag --max-num-batched-tokens 256;agent@0.45",
        help="loads to predict: WORKLOAD[@RATE][ ENGINE ARGS], separated by ';'",
    )
    ap.add_argument("--rate", type=float, default=0.3)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--length-scale", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--source", choices=("runs", "grid"), default="runs")
    ap.add_argument("--sim-seeds", type=int, default=5, help="simulations per comparison")
    ap.add_argument(
        "--rounds", type=int, default=2, help="real runs of every case, training and held-out"
    )
    ap.add_argument("--grid", default="default", help="grid for --source grid (default, quick)")
    ap.add_argument("--out", default=f"runs/fidelity-{time.strftime('%Y%m%d-%H%M%S')}")
    ap.add_argument("--reuse", metavar="DIR", help="real runs from this earlier --out")
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.sim_seeds < 1:
        raise SystemExit("--rounds and --sim-seeds must be at least 1")
    return a


def real_run(
    a: argparse.Namespace, out: Path, name: str, case: Case, required: bool
) -> Path | None:
    """``servelab bench`` of ``case`` into ``out/name``; with ``--reuse``, that run of the
    earlier directory (None when it has none and it is not ``required``)."""
    if a.reuse:
        d = Path(a.reuse) / name
        if not (d / "steps.jsonl").is_file():
            if required:
                raise SystemExit(f"--reuse: no real run at {d}")
            return None
        return d
    d = out / name
    run([*SERVELAB, "bench", *load_args(a, case), "--out", str(d), "--quiet"])
    return d


def real_runs(
    a: argparse.Namespace, out: Path, train: list[Case], cases: list[Case]
) -> dict[Case, list[Path]]:
    """Every case's real runs, in rounds: training and held-out cases alternate, so that the
    machine's drift over minutes falls on both alike (sim.costs.drift)."""
    order = [x for pair in zip_longest(train, cases) for x in pair if x is not None]
    reals: dict[Case, list[Path]] = {c: [] for c in order}
    for rnd in range(a.rounds):
        for case in order:
            kind = "train" if case in train else "real"
            suffix = f"-rep{rnd + 1}" if rnd else ""
            d = real_run(a, out, f"{kind}-{case.name}{suffix}", case, required=rnd == 0)
            if d is not None:
                reals[case].append(d)
    return reals


def profile_runs(run_dirs: list[Path], table: Path) -> None:
    """``servelab profile --from-run`` over ``run_dirs``, written to ``table``."""
    from_runs = [arg for d in run_dirs for arg in ("--from-run", str(d))]
    run([*SERVELAB, "profile", *from_runs, "--out", str(table)])


def simulate(a: argparse.Namespace, out: Path, table: Path, case: Case, name: str) -> list[Path]:
    """One simulation per sim seed (run directories name/seedK)."""
    seeds = []
    for k in range(a.sim_seeds):
        d = out / name / f"seed{k}"
        cmd = [*SERVELAB, "sim", "--profile", str(table), *load_args(a, case)]
        run([*cmd, "--sim-seed", str(k), "--out", str(d)], quiet=True)
        seeds.append(d)
    return seeds


def compare(
    a: argparse.Namespace, out: Path, profile: Path, cases: list[Case], reals: dict
) -> dict[str, dict[str, dict]]:
    """Per held-out case and figure: the real mean and spread, the simulated median and its
    error, each seed's error and the in-sample control's."""
    results: dict[str, dict[str, dict]] = {}
    for case in cases:
        w = case.label
        sims = simulate(a, out, profile, case, f"sim-{case.name}")
        # In-sample control: a profile made of this case's own steps. Its error is what the
        # simulator itself gets wrong (scheduling, client, interpolation); the held-out error
        # minus this one is what changed on the machine between runs.
        own = out / f"profile-{case.name}.json"
        profile_runs(reals[case], own)
        insims = simulate(a, out, own, case, f"insim-{case.name}")
        real_metrics = [overall(d) for d in reals[case]]
        repeats = [figures(m) for m in real_metrics]
        repeat_cis = [relative_cis(m) for m in real_metrics]
        seeds = [figures(overall(d)) for d in sims]
        insample = [figures(overall(d)) for d in insims]
        results[w] = {}
        for k in repeats[0]:
            real = statistics.fmean(r[k] for r in repeats)
            s = statistics.median(f[k] for f in seeds)
            cis = [c[k] for c in repeat_cis if k in c]
            results[w][k] = {
                "real": real,
                "real_repeats": [r[k] for r in repeats],
                "real_spread": max(abs(r[k] - real) for r in repeats) / real if real else None,
                "one_run_ci": [statistics.fmean(c[i] for c in cis) for i in (0, 1)]
                if cis
                else None,
                "sim": s,
                "error": rel_error(s, real),
                "seed_errors": [rel_error(f[k], real) for f in seeds],
                "in_sample_error": rel_error(statistics.median(f[k] for f in insample), real),
            }
    return results


def show(
    a: argparse.Namespace, results: dict[str, dict[str, dict]], n_real: int, took: float
) -> None:
    print(
        f"\nsimulated vs real on this machine ({a.source} profile of {a.train}; "
        f"{a.requests} requests each; real: mean of {n_real} runs; sim: median of "
        f"{a.sim_seeds} sim seeds; {took:.0f} s in all)"
    )
    header = (
        f"{'case':10s} {'metric':14s} {'real':>10s} {'one run CI':>14s} {'sim':>10s} "
        f"{'error':>8s} {'one seed':>13s} {'in-sample':>9s} {'real vs real':>12s}  target"
    )
    print(header)
    within = total = 0
    for w, res in results.items():
        print(w)
        for k, v in res.items():
            target = 0.05 if k == "output_tok_s" else 0.10
            err = v["error"]
            total += err is not None
            within += err is not None and abs(err) <= target
            mark = "" if err is None else ("ok" if abs(err) <= target else "MISSED")
            err_s = "-" if err is None else f"{err:+.1%}"
            ins = v["in_sample_error"]
            ins_s = "-" if ins is None else f"{ins:+.1%}"
            seed = [e for e in v["seed_errors"] if e is not None]
            seed_s = f"{min(seed):+.0%}..{max(seed):+.0%}" if seed else "-"
            spread = v["real_spread"]
            spread_s = "-" if spread is None or len(v["real_repeats"]) < 2 else f"±{spread:.1%}"
            ci = v["one_run_ci"]
            ci_s = "-" if not ci else f"{ci[0]:+.0%}..{ci[1]:+.0%}"
            print(
                f"{'':10s} {k:14s} {v['real']:10.4g} {ci_s:>14s} {v['sim']:10.4g} {err_s:>8s} "
                f"{seed_s:>13s} {ins_s:>9s} {spread_s:>12s}  {target:.0%} {mark}"
            )
    print(f"{within} of {total} figures within target")


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    train = parse_cases(a.train, a.rate, ",") if a.source == "runs" else []
    cases = parse_cases(a.heldout, a.rate, ";")
    if set(train) & set(cases):
        raise SystemExit("a held-out case is also a training case: give it another rate or args")
    reals = real_runs(a, out, train, cases)
    profile = out / "profile.json"
    if a.source == "runs":
        profile_runs([d for c in train for d in reals[c]], profile)
    else:
        run([*SERVELAB, "profile", "--grid", a.grid, "--out", str(profile)])
    results = compare(a, out, profile, cases, reals)
    n_real = min(len(reals[c]) for c in cases)
    show(a, results, n_real, time.perf_counter() - t_start)
    (out / "fidelity.json").write_text(json.dumps({"args": vars(a), "results": results}, indent=1))
    print(f"wrote {out / 'fidelity.json'}")


if __name__ == "__main__":
    main()
