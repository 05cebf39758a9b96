"""Re-predict recorded `tune --verify` verifications on the requests they measured.

    .venv/bin/python -m benchmarks.analyze.tune_rescore DIR [DIR ...] [--cases A,B] [--seeds 5]

Each DIR is a `benchmarks.analyze.tune_fidelity` output (``CASE/run``, ``CASE/tune.json``,
``CASE/verify``). For every case that verified a setting it rebuilds the tuning of
``CASE/run`` (``workflows.tuning_loop.predict``, the case's objective), finds the verified
arms among its candidates by title, predicts every arm on each repeat's own requests
(``fresh_predictions``) and scores the recorded runs again (``verify``). It prints, per arm,
the predicted change on the run (as first reported) and on the measured requests beside the
measured change, and the totals both ways. Nothing is run on a server: a re-prediction of
measurements already made, reported beside the first score, never in its place.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import fmean
from typing import Any

from benchmarks.analyze.tune_fidelity import ALL_CASES
from servelab.analyze.tuning.verification import AS_RUN, Arm, verify
from servelab.rundir import load_run
from servelab.workflows.tuning_loop import TuneSpec, fresh_predictions, predict, run_slos


def rescore_case(case_dir: Path, objective: str | None, seeds: int) -> dict[str, Any] | None:
    doc = json.loads((case_dir / "tune.json").read_text())
    recorded = doc.get("verification") or {}
    if not recorded.get("arms"):
        return None
    run = load_run(case_dir / "run")
    spec = TuneSpec(case_dir / "run", seeds=seeds, objective=objective, ignore_gates=True)
    tuning = predict(run, spec)
    if tuning.refused or tuning.baseline is None or tuning.decision is None:
        return {"case": case_dir.name, "error": f"not predicted now: {tuning.refused}"}
    by_title = {j.candidate.title: j for j in tuning.judged}
    obj = tuning.decision.objective
    arms: list[tuple[Arm, Any]] = [
        (Arm(AS_RUN, "as run", tuning.baseline, (obj.scope, obj.figure)), None)
    ]
    for a in recorded["arms"]:
        j = by_title.get(a["title"])
        if j is None:
            return {"case": case_dir.name, "error": f"arm {a['title']!r} is not a candidate now"}
        arms.append((Arm(a["arm"], a["title"], j.prediction, j.candidate.target), j.candidate))
    verify_dir = case_dir / "verify"
    reps = sorted(int(p.name.rpartition("-r")[2]) for p in verify_dir.glob(f"{AS_RUN}-r*"))
    runs = {a.name: [load_run(verify_dir / f"{a.name}-r{r}") for r in reps] for a, _ in arms}
    fresh = fresh_predictions(tuning.replica, arms, runs[AS_RUN], spec)
    v = verify([a for a, _ in arms], runs, (obj.scope, obj.figure), run_slos(run), fresh=fresh)
    return {
        "case": case_dir.name,
        "arms": [
            {
                "arm": r.name,
                "title": r.title,
                "objective": c.to_dict(),
                "first": next(x for x in recorded["arms"] if x["arm"] == r.name)["objective"],
                "key": r.key.to_dict(),
                "key_first": next(x for x in recorded["arms"] if x["arm"] == r.name)["key"],
            }
            for r in v.arms
            for c in [r.objective]
        ],
        "mape": v.mape,
        "mape_first": recorded.get("mape"),
    }


def _pct(x: float | None) -> str:
    return "    -" if x is None else f"{x:+6.1%}"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--cases", default=None, help="only these case names")
    ap.add_argument("--seeds", type=int, default=5, help="simulator seeds, as the evaluation ran")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    a = ap.parse_args()
    objective = {c.name: c.objective for c in ALL_CASES}
    only = set(a.cases.split(",")) if a.cases else None
    rows = []
    for d in a.dirs:
        for case_dir in sorted(p.parent for p in d.glob("*/tune.json")):
            if only is not None and case_dir.name not in only:
                continue
            row = rescore_case(case_dir, objective.get(case_dir.name), a.seeds)
            if row is None:
                continue
            rows.append(row)
            print(f"\n== {d.name}/{case_dir.name}", flush=True)
            if "error" in row:
                print(f"   {row['error']}")
                continue
            for arm in row["arms"]:
                for what, now, first in (
                    ("objective", arm["objective"], arm["first"]),
                    ("key", arm["key"], arm["key_first"]),
                ):
                    print(
                        f"   {arm['arm']:6} {what:9} {now['figure']:14} measured {_pct(now['measured_change'])}"
                        f"  predicted on the run {_pct(now['predicted_change_on_run'])} (error {_pct(first['error'])[1:]})"
                        f"  on its requests {_pct(now['predicted_change'])} (error {_pct(now['error'])[1:]})"
                    )
    scored = [r for r in rows if "error" not in r]
    for part in ("objective", "key"):
        first = [
            e
            for r in scored
            for x in r["arms"]
            if (e := x["first" if part == "objective" else "key_first"]["error"]) is not None
        ]
        now = [e for r in scored for x in r["arms"] if (e := x[part]["error"]) is not None]
        if first and now:
            print(
                f"\nMAPE of the predicted changes, {part}: {fmean(first):.1%} predicted on the runs, "
                f"{fmean(now):.1%} on the requests measured ({len(now)} arms of {len(scored)} cases)"
            )
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
