"""Fit the simulated vLLM's step costs and serving path on the 13 fitting runs of
``benchmarks/sim/data/blis_vllm_runs.json`` (never on the 38 evaluation runs).

    python -m benchmarks.sim.gpu_runs_fit step          # the step costs, from the figures
    python -m benchmarks.sim.gpu_runs_fit path FILE     # the serving path, from a
                                                        # gpu_runs --split fit --json FILE

``step``: each load stage of a dense fitting run is a steady decode at Little's law's
concurrency B = rate x measured E2E, every sequence at the prompt plus half the output in
context, so its mean step time is (E2E - TTFT) / (output tokens - 1). The roofline's
``decode_time(B, context)`` is fitted to those times (MBU, step, layer and per
sequence-layer costs; least squares on log time). Stages whose measured ITL implies an
output length more than 10% off the requested one are left out (that load generator's
counts are unreliable there, so the step time is unknown).

``path``: with the fitted steps simulated and no serving path, the measured TTFT less the
simulated one, per stage, regressed on the simulated step time: the intercept is the
per-request inbound time, the slope the output lag in steps.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from benchmarks.sim.gpu_runs import HARDWARE, load_data, model_spec


def stage_points(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The fitting runs' dense stages as (run, B, context, measured step time)."""
    pts = []
    for run in data["runs"]:
        cfg = data["models"][run["model"]]
        if run["split"] != "fit" or cfg.get("num_local_experts"):
            continue
        w = data["workloads"][run["workload"]]
        prompt = 1 + w["system_prompt_len"] + w["question_len"]
        out = w["output_len"]
        for st, m in run["measured"].items():
            if st == "-1":
                continue
            implied = (m["e2e_mean"] - m["ttft_mean"]) / m["itl_mean"] + 1
            if abs(implied / out - 1) > 0.10:
                continue
            rate = w["stages"][int(st)][0]
            b = rate * m["e2e_mean"] / 1e3
            pts.append(
                {
                    "run": run,
                    "stage": st,
                    "seqs": b,
                    "context": b * (prompt + out / 2),
                    "step": (m["e2e_mean"] - m["ttft_mean"]) / (out - 1) / 1e3,
                }
            )
    return pts


def predict(pt: dict[str, Any], data: dict[str, Any], eff: Any) -> float:
    from servelab.sim.costs.hardware import get_hardware
    from servelab.sim.costs.roofline import RooflineCostModel

    run = pt["run"]
    spec = model_spec(run["model"], data["models"][run["model"]], 4096)
    hw = get_hardware(HARDWARE[run["hardware"]])
    cm = RooflineCostModel(spec, hw, tp=run["tp"], efficiency=eff)
    b = pt["seqs"]
    lo = math.floor(b)
    # decode_time takes whole sequences: interpolate between the two neighbours.
    t0 = cm.decode_time(max(lo, 1), int(pt["context"] * max(lo, 1) / b))
    t1 = cm.decode_time(lo + 1, int(pt["context"] * (lo + 1) / b))
    return t0 + (t1 - t0) * (b - lo)


def fit_step(data: dict[str, Any]) -> None:
    from scipy.optimize import least_squares

    from servelab.sim.costs.roofline import Efficiency

    pts = stage_points(data)

    def eff(x: Any) -> Any:
        return Efficiency(
            mbu=min(1.0, x[0]),
            step_overhead=x[1] * 1e-3,
            layer_overhead=x[2] * 1e-6,
            seq_layer_overhead=x[3] * 1e-6,
        )

    def resid(x: Any) -> list[float]:
        e = eff(x)
        return [math.log(predict(p, data, e) / p["step"]) for p in pts]

    base = [math.log(predict(p, data, Efficiency()) / p["step"]) for p in pts]
    res = least_squares(resid, [0.75, 1.0, 5.0, 0.5], bounds=([0.3, 0, 0, 0], [1, 10, 100, 10]))
    print(
        f"{len(pts)} stages; fitted mbu {res.x[0]:.3f}, step {res.x[1]:.3f} ms, "
        f"layer {res.x[2]:.2f} us, seq x layer {res.x[3]:.3f} us"
    )
    for p, b0, r in zip(pts, base, res.fun):
        print(
            f"  {p['run']['id'][:36]:<36} stage {p['stage']} B {p['seqs']:6.1f} "
            f"measured {p['step'] * 1e3:6.2f} ms  default {math.expm1(b0):+6.1%}  "
            f"fitted {math.expm1(r):+6.1%}"
        )


def fit_path(data: dict[str, Any], sims: dict[str, Any]) -> None:
    xs, ys, ys99 = [], [], []
    for run in data["runs"]:
        sim = sims.get(run["id"], {})
        if run["split"] != "fit" or "refused" in sim:
            continue
        out = data["workloads"][run["workload"]]["output_len"]
        for st, m in run["measured"].items():
            p = sim.get(st)
            if st == "-1" or not p:
                continue
            xs.append((p["e2e_mean"] - p["ttft_mean"]) / (out - 1))
            ys.append(m["ttft_mean"] - p["ttft_mean"])
            ys99.append(m["ttft_p99"] - p["ttft_p99"])
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    print(f"{n} stages: TTFT mean gap = {my - slope * mx:.2f} ms + {slope:.3f} x step (OLS)")
    # Theil-Sen: one stage far off the line (Scout reasoning-lite) does not tilt it.
    slopes = [
        (ys[j] - ys[i]) / (xs[j] - xs[i])
        for i in range(n)
        for j in range(i + 1, n)
        if abs(xs[j] - xs[i]) > 1e-9
    ]
    ts = statistics.median(slopes)
    icpt = statistics.median(y - ts * x for x, y in zip(xs, ys))
    print(f"{n} stages: TTFT mean gap = {icpt:.2f} ms + {ts:.3f} x step (Theil-Sen)")
    for x, y, y99 in zip(xs, ys, ys99):
        print(f"  step {x:6.2f} ms  gap {y:6.2f} ms  p99 gap {y99:6.2f} ms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("step", "path"))
    ap.add_argument("sims", nargs="?", type=Path)
    args = ap.parse_args(argv)
    data = load_data()
    if args.what == "step":
        fit_step(data)
    else:
        if args.sims is None:
            ap.error("path needs the gpu_runs --json FILE of the fitting runs")
        fit_path(data, json.loads(args.sims.read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
