"""The held-out protocol of the live twin checks (benchmarks/sim/twin_check.py): its scores on
small synthetic prediction.json / metrics.json directories, its seeds, its launches and its
case lists' minimums, for vLLM and llama-server. No server runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.sim import twin_check as tc
from benchmarks.sim import twin_llamacpp, twin_vllm
from servelab.sim.intervals import FIGURES

SERVERS = [twin_vllm, twin_llamacpp]
TRAIN = tc.Case("train chat c4", "chat", "--concurrency 4 --requests 16", train=True, seed=1)


def _write_pred(d: Path, medians: dict[str, float], intervals: dict | None = None) -> None:
    """A prediction.json: each figure's median, a +-10% range over seeds and, if given,
    the stated intervals (level -> relative half-width either side)."""
    d.mkdir(parents=True)
    figures = {}
    for name, m in medians.items():
        f: dict = {"median": m, "interval": [m * 0.9, m * 1.1]}
        if intervals:
            f["intervals"] = {lvl: [m * (1 - w), m * (1 + w)] for lvl, w in intervals.items()}
        figures[name] = f
    (d / "prediction.json").write_text(json.dumps({"figures": figures}))


def _write_run(d: Path, values: dict[str, float]) -> None:
    """A metrics.json whose figures (``FIGURES`` names) are ``values``; others absent."""
    d.mkdir(parents=True)
    lat: dict = {}
    tput = {}
    for name, metric, stat in FIGURES:
        if name not in values:
            continue
        if metric is None:
            tput["output_tokens_per_s"] = values[name]
        else:
            lat.setdefault(metric, {})[stat] = values[name]
    overall = {"latency": lat, "throughput": tput}
    (d / "metrics.json").write_text(json.dumps({"overall": overall}))


def _layout(tmp_path: Path) -> tuple[list[tc.Case], list[tc.Case]]:
    """Two training runs (TTFT p50 0.1 and 0.3 s: the reference 0.2), the twin's prediction
    of the training case (0.25) and two held-out cases:

    - A: predicted 0.5, measured 0.4: twin 25% off, naive 50%; change +100% both ways;
    - B: predicted 0.3, measured 0.2: twin 50% off, naive 0%; change +20% against 0.

    Output tok/s: 10 and 30 in training, 10 predicted for it; A predicted 20 and measured
    20, B measured 0 (not scored)."""
    train = tc.training(TRAIN, 2)
    held = [
        tc.Case("A", "rag", "--concurrency 4 --requests 4", seed=101),
        tc.Case("B", "codegen", "--rate 1 --requests 4", seed=102),
    ]
    _write_run(tmp_path / f"real-{train[0].slug}", {"ttft_p50": 0.1, "output_tok_s": 10})
    _write_run(tmp_path / f"real-{train[1].slug}", {"ttft_p50": 0.3, "output_tok_s": 30})
    _write_pred(tmp_path / f"sim-{train[0].slug}", {"ttft_p50": 0.25, "output_tok_s": 10})
    _write_pred(tmp_path / "sim-A", {"ttft_p50": 0.5, "output_tok_s": 20}, {"80": 0.1, "95": 0.3})
    _write_run(tmp_path / "real-A", {"ttft_p50": 0.4, "output_tok_s": 20})
    _write_pred(tmp_path / "sim-B", {"ttft_p50": 0.3, "output_tok_s": 20}, {"80": 0.1, "95": 0.6})
    _write_run(tmp_path / "real-B", {"ttft_p50": 0.2, "output_tok_s": 0})
    return train, held


# ------------------------------------------------------------------------- scoring


def test_a_figure_scores_the_twin_the_naive_baseline_and_the_change():
    r = tc.row(predicted=0.5, measured_=0.4, ref=0.2, ref_predicted=0.25)
    assert r["error"] == pytest.approx(0.25)
    assert r["naive_error"] == pytest.approx(-0.5)
    assert r["measured_change"] == pytest.approx(1.0)
    assert r["predicted_change"] == pytest.approx(1.0)
    assert r["change_error"] == pytest.approx(0.0)
    # a twin off by one factor everywhere still gets the change right
    off = tc.row(predicted=0.8, measured_=0.4, ref=0.2, ref_predicted=0.4)
    assert off["error"] == pytest.approx(1.0) and off["change_error"] == pytest.approx(0.0)
    # a missing figure is not scored
    assert tc.row(None, 0.4, 0.2, 0.25)["error"] is None
    assert tc.row(0.5, 0.0, 0.2, 0.25)["naive_error"] is None


def test_mape_naive_baseline_and_change_error_per_figure_over_held_out_runs(tmp_path):
    train, held = _layout(tmp_path)
    results = tc.evaluate(tmp_path, train, held, in_sample=True)
    assert [r["case"] for r in results] == [
        "train chat c4 (in-sample)", "train chat c4 relaunched (in-sample)", "A", "B",
    ]  # fmt: skip
    assert [r["seed"] for r in results] == [1, 1, 101, 102]
    s = tc.score(results)
    assert set(s) == set(tc.PROTOCOL_FIGURES)
    ttft = s["ttft_p50"]
    assert ttft["cases"] == 2  # the training runs are not scored
    assert ttft["twin_mape"] == pytest.approx(37.5)
    assert ttft["naive_mape"] == pytest.approx(25.0)
    assert ttft["change_error_pp"] == pytest.approx(10.0)
    assert ttft["target_mape"] == 15.0 and ttft["met"] is False
    tput = s["output_tok_s"]  # B measured 0: only A scored; the reference is the mean, 20
    assert tput["cases"] == 1 and tput["twin_mape"] == pytest.approx(0.0)
    assert tput["naive_mape"] == pytest.approx(0.0)
    assert tput["change_error_pp"] == pytest.approx(100.0)  # predicted +100%, measured 0
    assert s["e2e_mean"]["cases"] == 0 and s["e2e_mean"]["met"] is None
    # without the twin fitted to the training runs they are not called in-sample
    assert tc.evaluate(tmp_path, train, held, in_sample=False)[0]["case"] == "train chat c4"


def test_coverage_of_the_stated_intervals_on_held_out_runs(tmp_path):
    train, held = _layout(tmp_path)
    summary = tc.summarize(tmp_path, tc.evaluate(tmp_path, train, held, True), held)
    cov = summary["intervals"]
    # A: 0.4 against 0.5 (80%: 0.45-0.55 no; 95%: 0.35-0.65 yes), 20 against 20 (both yes);
    # B: 0.2 against 0.3 (80% no; 95%: 0.12-0.48 yes); its output 0 is not judged
    assert cov["80"]["figures"] == 3 and cov["80"]["coverage"] == pytest.approx(1 / 3)
    assert cov["95"]["coverage"] == pytest.approx(1.0)
    assert cov["80"]["median_width"] == pytest.approx(0.2)
    assert cov["95"]["median_width"] == pytest.approx(0.6)
    assert cov["seeds range"]["coverage"] == pytest.approx(1 / 3)
    assert summary["intervals_met"] == {"80": False, "95": False}  # 33% < 70%, 100% > 99%
    assert tc.coverage_met({"80": {"coverage": 0.8}}) == {"80": True, "95": None}


def test_the_tables_fit_100_columns_and_say_each_target(tmp_path):
    train, held = _layout(tmp_path)
    results = tc.evaluate(tmp_path, train, held, True)
    summary = tc.summarize(tmp_path, results, held)
    long = [{**results[2], "case": max((c.name for c in twin_vllm.HELD_OUT), key=len)}]
    cases = tc.render_cases([*results, *long])
    speeds = tc.render_speeds([*results, *long])
    assert "| A | - | - |" in speeds and "train" not in speeds  # no twin, no E2E here
    assert all(len(line) <= 100 for line in speeds.splitlines())
    table = tc.render_score(summary["figures"], summary["intervals"])
    assert all(len(line) <= 100 for line in [*cases.splitlines(), *table.splitlines()])
    assert "| ttft_p50 | 2 | 37.5% | 25.0% | 10.0 pp | <= 15% missed |" in table
    assert "| 80 | 3 | 33% | 70%-90% | 20% |" in table
    assert "| A | ttft_p50 | 500.0 | 400.0 | +25% | -50% | +100%/+100% |" in cases
    rows = cases.splitlines()
    assert [x.split(" | ")[1] for x in rows[2:12]] == list(tc.PROTOCOL_FIGURES)
    assert rows[2].startswith("| train chat c4 | ") and rows[-1].startswith("training runs: in-")


# --------------------------------------------------------------- seeds and launches


@pytest.mark.parametrize("server", SERVERS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_held_out_seed_is_new_and_every_case_gets_its_own_launch(server):
    train = tc.training(server.TRAIN, 2)
    used = {c.seed for c in train} | tc.plan_seeds()
    held = list(server.HELD_OUT)
    assert all(c.seed not in used for c in held)
    assert len({c.seed for c in held}) == len(held)
    runs = tc.launches(train, held)
    assert len(runs) == len(train) + len(held)  # one launch per measured run
    assert [c for _, c in runs] == [*train, *held]  # training first
    assert len({label for label, _ in runs}) == len(runs)  # logs kept apart


def test_a_seed_used_in_training_is_refused_before_any_server_starts(tmp_path):
    held = [tc.Case("rag c4", "rag", "--concurrency 4 --requests 4", seed=1)]
    problems = tc.protocol_problems([TRAIN], held)
    assert "rag c4: seed 1 was used in training" in problems
    twice = [tc.Case(n, "rag", "--rate 1", seed=5) for n in ("a", "b")]
    assert "seed 5 is given to several cases" in tc.protocol_problems([TRAIN], twice)
    plan = [tc.Case("x", "rag", "--rate 1", seed=3)]  # a calibrate --plan rung's seed
    assert any("seed 3" in p for p in tc.protocol_problems([TRAIN], plan, tc.plan_seeds()))
    peer = tc.Peer("none", "false {port}", "false", "m", "t", None, lambda *a: 0.0)
    with pytest.raises(SystemExit, match="seed 1 was used in training"):
        tc.check(peer, [TRAIN], held, tmp_path)
    assert not (tmp_path / "logs").exists()


# ---------------------------------------------------------------- the case lists


@pytest.mark.parametrize("server", SERVERS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_the_case_lists_meet_the_protocols_minimums(server):
    train, held = [server.TRAIN], list(server.HELD_OUT)
    assert tc.protocol_problems(train, held, tc.plan_seeds()) == []
    assert len(held) >= 8
    shapes = {tc.shape_of(c) for c in held} - {tc.shape_of(server.TRAIN)}
    assert {"rag", "codegen", "agent", "chat gamma 0.25"} <= shapes
    assert len({c.flags for c in held} - {""}) >= 2
    loads = {tc.load_of(c) for c in held} - {tc.load_of(server.TRAIN)}
    assert "concurrency 8" in loads and any(x.startswith("rate") for x in loads)


def test_short_lists_are_told_what_they_lack():
    one = [tc.Case("chat c4 again", "chat", "--concurrency 4 --requests 16", seed=7)]
    problems = tc.protocol_problems([TRAIN], one)
    assert "1 held-out cases, fewer than 8" in problems
    assert "0 workload shapes not in training, want 3" in problems
    assert "0 flag changes, want 2" in problems
    assert any(p.startswith("new loads []") for p in problems)
    closed = [tc.Case(f"c{n}", "chat", f"--concurrency {n}", seed=n) for n in (2, 8)]
    assert any("one an open loop" in p for p in tc.protocol_problems([TRAIN], closed))


def test_vllm_and_llama_server_run_the_same_cases_where_the_flags_translate():
    pairs = list(zip(twin_vllm.HELD_OUT, twin_llamacpp.HELD_OUT, strict=True))
    assert all(v.seed == ll.seed and v.workload == ll.workload for v, ll in pairs)
    assert all(bool(v.flags) == bool(ll.flags) for v, ll in pairs)
    assert twin_vllm.TRAIN == twin_llamacpp.TRAIN
    with pytest.raises(SystemExit, match="no case named nope"):
        tc.select(twin_vllm.HELD_OUT, "rag c4,nope", {})
    assert [c.name for c in tc.select(twin_vllm.HELD_OUT, "smoke", {"smoke": ("chat c8",)})] == [
        "chat c8"
    ]


def test_held_out_cases_can_be_planned_from_new_seeds_and_still_clear_training():
    fresh = tc.select(twin_llamacpp.HELD_OUT, "all", {}, seed_from=201)
    assert [c.seed for c in fresh] == list(range(201, 201 + len(twin_llamacpp.HELD_OUT)))
    assert [c.name for c in fresh] == [c.name for c in twin_llamacpp.HELD_OUT]
    # a subset keeps each case's place in the list, so its seed does not depend on --cases
    assert [c.seed for c in tc.select(twin_llamacpp.HELD_OUT, "chat c8", {}, 201)] == [206]
    assert not tc.protocol_problems([TRAIN], fresh, tc.plan_seeds())
    clash = tc.select(twin_llamacpp.HELD_OUT, "all", {}, seed_from=1)
    assert any("seed 1 was used in training" in p for p in tc.protocol_problems([TRAIN], clash))


def test_the_ladder_and_the_training_runs_are_fitted_together_without_the_warm_up(tmp_path):
    from dataclasses import asdict

    from servelab.sim.calibration_run import expand_plans
    from servelab.workflows.calibration_plan import ladder

    plan = tmp_path / "plan"
    plan.mkdir()
    rungs = ladder(tc.PLAN_MAX_PROMPT, (1, 2, 4, 8))
    (plan / "plan.json").write_text(json.dumps({"rungs": [asdict(r) for r in rungs]}))
    got = expand_plans([str(plan), str(tmp_path / "run")])
    assert got == [str(plan / r.name) for r in rungs[1:]] + [str(tmp_path / "run")]
    assert rungs[0].kind == "warmup"
    with pytest.raises(SystemExit, match="not both"):
        tc.check(None, [TRAIN], [], tmp_path, train_plan=True, train_plan_and_runs=True)  # type: ignore[arg-type]
