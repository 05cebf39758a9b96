"""What-ifs end to end: workloads and traces in, run directories out, calibration, capacity."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from servelab.bench.workloads.request_plan import LoadSpec
from servelab.cli import app
from servelab.engine.engine_config import EngineConfig
from servelab.rundir import load_run
from servelab.sim.capacity import best_pd_split, fewest_replicas, highest_rate
from servelab.sim.costs.hardware import HARDWARE
from servelab.sim.costs.model_shapes import PRESETS
from servelab.sim.costs.roofline import Efficiency
from servelab.sim.engine_args import parse_engine_args, parse_sweep
from servelab.sim.fit.calibrate import Calibration, fit_efficiency
from servelab.sim.fit.recorded_steps import measured_steps
from servelab.sim.loop.links import parse_link
from servelab.sim.loop.simulation import Topology
from servelab.sim.run_writer import write_run_dir
from servelab.sim.scenario import Scenario, load_requests, simulate
from servelab.sim.sim_target import roofline_target
from servelab.units import SLO

AZURE, MOONCAKE = "azure-2023-conv", "mooncake-synthetic"  # the traces the package ships


def test_engine_args_accept_vllm_flags_and_key_values():
    args = parse_engine_args(
        "max_num_seqs=8 --max-num-batched-tokens 512, --no-enable-chunked-prefill "
        "num_gpu_blocks_override=100 kv_cache_memory=512MiB tp=2"
    )
    assert args == {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "enable_chunked_prefill": False,
        "num_kv_blocks": 100,
        "kv_cache_memory_gb": pytest.approx(512 * 1024**2 / 1e9),
        "tp": 2,
    }
    with pytest.raises(ValueError, match="known"):
        parse_engine_args("max_num_sequences=3")
    with pytest.raises(ValueError, match="true or false"):
        parse_engine_args("enable_prefix_caching=maybe")
    grid = parse_sweep(["max_num_seqs=8,16", "enable_prefix_caching=true,false"])
    assert len(grid) == 4 and {"max_num_seqs": 16, "enable_prefix_caching": False} in grid


def test_workload_requests_keep_the_plans_lengths_times_and_shared_prefixes():
    load = LoadSpec(rate=4.0, requests=40)
    reqs, info, slos = load_requests("rag", load, seed=3, max_model_len=8192)
    assert info["workload"]["name"] and set(slos) == {"rag"}
    from servelab.bench.workloads.request_plan import build_plan
    from servelab.bench.workloads.spec import load_workload
    from servelab.modelcore.tokenizer import Tokenizer

    plan = build_plan(load_workload("rag"), load, 3, tokenizer=Tokenizer.from_model("smollm2-135m"))
    for p, r in zip(plan, reqs):
        assert (r.request_id, r.send_time, r.max_tokens) == (
            p.request_id,
            p.send_time,
            p.max_tokens,
        )
        assert len(r.prompt_token_ids) == p.prompt_tokens
    # Requests of one prefix group share their prefix tokens exactly.
    by_group: dict[str, list] = {}
    for p, r in zip(plan, reqs):
        if p.tags.prefix_group:
            by_group.setdefault(p.tags.prefix_group, []).append(
                (p.prefix_tokens, r.prompt_token_ids)
            )
    shared = [v for v in by_group.values() if len(v) > 1]
    assert shared
    for group in shared:
        n, first = group[0][0], group[0][1]
        assert all(ids[: n - 2] == first[: n - 2] for _, ids in group)


def test_trace_requests_are_scaled_by_the_benchmarks_rules():
    reqs, info, slos = load_requests(
        None, LoadSpec(trace=AZURE, requests=200), seed=0, max_model_len=8192
    )
    assert len(reqs) == 200 and slos is None and info["trace"]["format"] == "azure"
    assert reqs[0].send_time == 0.0 and reqs[-1].send_time > 0
    assert len(reqs[1].prompt_token_ids) == 396 and reqs[1].max_tokens == 109  # row 2 of the CSV
    # Unique prompts: no two requests share their first KV block.
    heads = {tuple(r.prompt_token_ids[:16]) for r in reqs}
    assert len(heads) == len(reqs)
    mreqs, minfo, _ = load_requests(
        None, LoadSpec(trace=MOONCAKE, requests=50, length_scale=0.05), seed=0, max_model_len=8192
    )
    assert minfo["trace"]["format"] == "mooncake"
    assert all(len(r.prompt_token_ids) <= 8192 for r in mreqs)


def test_simulated_run_dir_reads_back_and_passes_diagnose(tmp_path):
    from servelab.analyze.diagnosis.diagnose import diagnose

    target = roofline_target("h200", "llama-3.1-8b", engine_config=EngineConfig(max_num_seqs=16))
    reqs, info, slos = load_requests("mixed", LoadSpec(rate=30.0, requests=80), 0, 8192)
    res = simulate(Scenario(target, reqs, network_delay=0.001, slos=slos))
    d = write_run_dir(
        tmp_path / "run",
        res,
        target=target.describe(),
        workload=info["workload"],
        load=info["load"],
        slos=slos,
        n_boot=50,
    )
    run = load_run(d)
    assert run.simulated and run.model == "llama-3.1-8b"
    assert len(run.records) == len(reqs) and len(run.timelines) == len(reqs)
    assert len(run.steps) == res.num_steps
    metrics = json.loads((d / "metrics.json").read_text())
    assert metrics["counts"]["ok"] == len(reqs)
    diag = diagnose(run)
    parts = diag.to_dict()["ttft_attribution"]["overall"]["parts"]
    assert parts["queue"] > 0  # max_num_seqs=16 at 30 req/s queues


def test_calibration_recovers_known_efficiencies(tmp_path):
    truth = Efficiency(
        mfu=0.35, mbu=0.55, step_overhead=2e-3, layer_overhead=0.0, seq_overhead=3e-5
    )
    target = roofline_target(
        "h100",
        "llama-3.1-8b",
        efficiency=truth,
        engine_config=EngineConfig(max_num_seqs=48, max_num_batched_tokens=1024),
    )
    reqs, _, _ = load_requests("mixed", LoadSpec(rate=25.0, requests=120), 1, 8192)
    res = simulate(Scenario(target, reqs))
    d = write_run_dir(tmp_path / "measured", res, target=target.describe(), n_boot=0)
    steps = measured_steps(load_run(d))
    assert len(steps) == res.num_steps
    # The rebuilt work predicts the recorded durations exactly under the true efficiencies.
    rm = target.cost_model
    assert max(abs(rm.predict(m.work) - m.duration) / m.duration for m in steps) < 1e-6
    cal = fit_efficiency(PRESETS["llama-3.1-8b"], HARDWARE["h100"], steps)
    e = cal.efficiency
    assert e.mfu == pytest.approx(0.35, rel=0.05) and e.mbu == pytest.approx(0.55, rel=0.02)
    assert cal.fit["step_overhead_in_step"] == pytest.approx(2e-3, rel=0.1)
    assert cal.fit["error_fitted"]["p90"] < 0.01 < cal.fit["error_default"]["median"]
    path = cal.save(tmp_path / "cal.json")
    assert Calibration.load(path).efficiency.mbu == pytest.approx(e.mbu)


def _chat_scenario(rate: float, requests: int = 120) -> Scenario:
    target = roofline_target("l4", "llama-3.1-8b", engine_config=EngineConfig(max_num_seqs=32))
    reqs, _, _ = load_requests("chat", LoadSpec(rate=rate, requests=requests), 0, 8192)
    return Scenario(target, reqs, slos=SLO(ttft=1.0, itl=0.5))


def test_find_capacity_fewest_replicas_is_the_boundary():
    sc = _chat_scenario(rate=12.0)
    result = fewest_replicas(
        lambda n: simulate(
            sc.with_topology(Topology(replicas=n, router="least-loaded")), keep_steps=False
        ),
        sc.slos,
        target=0.9,
        max_replicas=16,
    )
    n = result.answer
    assert n is not None and n > 1
    by_n = {p.extra["replicas"]: p for p in result.points}
    assert by_n[n].meets and not by_n[n - 1].meets


def test_find_capacity_highest_rate_brackets_the_knee():
    def at(rate: float):
        return simulate(_chat_scenario(rate, requests=80), keep_steps=False)

    result = highest_rate(at, SLO(ttft=1.0, itl=0.5), start=2.0, rel_tol=0.1)
    assert result.answer is not None
    failing = [p.extra["rate"] for p in result.points if not p.meets]
    assert failing and min(failing) > result.answer
    assert min(failing) <= result.answer * 1.1 + 1e-9


def test_best_pd_split_tries_every_split():
    sc = _chat_scenario(rate=8.0, requests=60)
    link = parse_link("nvlink")
    result = best_pd_split(
        lambda p, d: simulate(
            sc.with_topology(Topology(prefill=p, decode=d, link=link)), keep_steps=False
        ),
        sc.slos,
        total=4,
    )
    assert [p.label for p in result.points] == ["1P:3D", "2P:2D", "3P:1D"]
    top = max(p.attainment for p in result.points)
    best = [p for p in result.points if p.attainment == top]
    assert result.answer in [(p.extra["prefill"], p.extra["decode"]) for p in best]
    assert all(p.extra["mean_e2e"] > 0 for p in result.points)


def test_cli_sim_writes_a_run_and_reports_bad_input(tmp_path):
    runner = CliRunner()
    out = tmp_path / "cli"
    r = runner.invoke(
        app,
        [
            "sim",
            "--hardware",
            "h100",
            "--model",
            "qwen2.5-7b",
            "--workload",
            "chat",
            "--rate",
            "4",
            "--requests",
            "20",
            "--replicas",
            "2",
            "--router",
            "least-loaded",
            "--network-delay",
            "2ms",
            "--out",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    assert load_run(out).simulated
    r = runner.invoke(
        app, ["sim", "--hardware", "tpu", "--workload", "chat", "--rate", "1", "--requests", "2"]
    )
    assert r.exit_code == 2 and "h200" in r.output
    r = runner.invoke(
        app,
        [
            "sim",
            "--hardware",
            "h100",
            "--model",
            "llama-3.1-70b",
            "--workload",
            "chat",
            "--rate",
            "1",
            "--requests",
            "2",
        ],
    )
    assert r.exit_code == 2 and "tp" in r.output


def test_cli_sim_takes_serve_flags_and_still_the_old_spelling_with_a_note(tmp_path):
    runner = CliRunner()
    base = ["sim", "--hardware", "h200", "--model", "llama-3.1-8b", "--workload", "chat"]
    base += ["--rate", "5", "--requests", "10", "--no-steps"]
    new = runner.invoke(
        app, [*base, "--engine-args", "--max-num-seqs 128 --tp 2", "--out", str(tmp_path / "new")]
    )
    old = runner.invoke(
        app, [*base, "--engine-args", "max_num_seqs=128 tp=2", "--out", str(tmp_path / "old")]
    )
    assert new.exit_code == old.exit_code == 0, new.output + old.output
    assert "note" not in new.stderr
    assert old.stderr.strip() == (
        "note: key=value is the old spelling; write --engine-args '--max-num-seqs 128 --tp 2'"
    )
    a, b = load_run(tmp_path / "new"), load_run(tmp_path / "old")
    assert a.engine_config == b.engine_config and a.engine_config["max_num_seqs"] == 128
    assert [r.output_tokens for r in a.records] == [r.output_tokens for r in b.records]


def test_cli_sim_defaults_its_load_as_bench_does(tmp_path):
    base = ["sim", "--hardware", "h200", "--model", "llama-3.1-8b", "--no-steps"]
    r = CliRunner().invoke(
        app, [*base, "--on-off", "1s,2s", "--rate", "4", "--out", str(tmp_path / "a")]
    )
    assert r.exit_code == 0, r.output
    load = load_run(tmp_path / "a").manifest["load"]
    assert (load["arrival"], load["on"], load["off"], load["requests"]) == ("onoff", 1.0, 2.0, 20)
    r = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "b")])  # chat, one at a time
    assert r.exit_code == 0, r.output
    load = load_run(tmp_path / "b").manifest["load"]
    assert (load["concurrency"], load["rate"], load["requests"]) == (1, None, 20)


def test_simulated_runs_go_through_diagnose_compare_and_report(tmp_path):
    runner = CliRunner()
    out = tmp_path / "sweep"
    r = runner.invoke(
        app,
        [
            "sim",
            "--hardware",
            "l4",
            "--model",
            "llama-3.1-8b",
            "--workload",
            "rag",
            "--rate",
            "2",
            "--requests",
            "30",
            "--sweep",
            "max_num_batched_tokens=256,2048",
            "--out",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    small, big = sorted(p for p in out.iterdir() if p.is_dir())
    assert json.loads((out / "sweep.json").read_text())[0]["label"].startswith(
        "max_num_batched_tokens"
    )
    r = runner.invoke(app, ["diagnose", str(small)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["compare", str(small), str(big)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["report", str(small), "--html", str(tmp_path / "r.html")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "r.html").stat().st_size > 10_000


def test_cli_calibrate_and_profile_from_a_run(tmp_path):
    from servelab.sim.costs.profiled import ProfiledCostModel, ProfileTable

    truth = Efficiency(mfu=0.4, mbu=0.6, step_overhead=1e-3, layer_overhead=0.0)
    target = roofline_target(
        "h100", "llama-3.1-8b", efficiency=truth, engine_config=EngineConfig(max_num_seqs=32)
    )
    reqs, _, _ = load_requests("chat", LoadSpec(rate=10.0, requests=60), 2, 8192)
    run = write_run_dir(
        tmp_path / "run", simulate(Scenario(target, reqs)), target=target.describe(), n_boot=0
    )
    runner = CliRunner()
    cal = tmp_path / "cal.json"
    r = runner.invoke(
        app,
        ["calibrate", str(run), "--hardware", "h100", "--model", "llama-3.1-8b", "--out", str(cal)],
    )
    assert r.exit_code == 0, r.output
    assert Calibration.load(cal).efficiency.mbu == pytest.approx(0.6, rel=0.03)
    prof = tmp_path / "p.json"
    r = runner.invoke(app, ["profile", "--from-run", str(run), "--out", str(prof)])
    assert r.exit_code == 0, r.output
    table = ProfileTable.load(prof)
    assert len(table.samples) == len(load_run(run).steps)
    assert table.meta["engine_config"]["max_num_seqs"] == 32
    assert ProfiledCostModel(table).fit_error < 0.03
    r = runner.invoke(app, ["calibrate", str(tmp_path), "--hardware", "h100"])
    assert r.exit_code == 2 and "run directory" in r.output


@pytest.mark.parametrize(
    ("engine_args", "sweep", "message"),
    [
        ("--max-num-seqs 0", None, "max_num_seqs must be >= 1"),
        ("--kv-cache bogus", None, 'kv_cache must be "fast" or "plain"'),
        (None, "max_num_seqs=0,4", "sweep point max_num_seqs=0"),
    ],
)
def test_sim_refuses_a_bad_engine_setting_without_a_traceback(
    tmp_path, engine_args, sweep, message
):
    args = ["sim", "--hardware", "h200", "--model", "llama-3.1-8b", "--workload", "chat"]
    args += ["--rate", "5", "--requests", "10", "--out", str(tmp_path / "run")]
    args += ["--engine-args", engine_args] if engine_args else ["--sweep", sweep]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2
    assert message in res.output
    assert "Traceback" not in res.output


def test_sim_runs_the_engine_on_the_plain_kv_cache(tmp_path):
    args = ["sim", "--hardware", "h200", "--model", "llama-3.1-8b", "--workload", "chat"]
    args += ["--rate", "5", "--requests", "10", "--engine-args", "--kv-cache plain"]
    res = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "run")])
    assert res.exit_code == 0, res.output
    assert load_run(tmp_path / "run").engine_config["kv_cache"] == "plain"
