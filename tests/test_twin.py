"""The twin of another server: its steps inferred from client timestamps, its settings from
what it reports, its launch command or what the user states, a step cost fitted to them,
predictions with ranges, and recommendations in its own flags.

The stand-in server runs planted engine steps (``bench.teststeps``): one loop of steps of a
known cost serves every stream, and ``/test/steps`` says what ran. It plays another server:
no timelines, no step records.
"""

from __future__ import annotations

import bisect
import io
import json
import math
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import rundirs

from servelab.analyze.diagnosis.diagnose import diagnose
from servelab.analyze.server_side.serversettings import parse_flags, render_flags, server_settings
from servelab.analyze.server_side.stepinfer import infer_steps
from servelab.rundir import load_run
from servelab.sim.fit.twin import TwinCalibration, fit_steps, step_work

PLAN = {"base": 0.02, "per_decode": 0.003, "per_prefill_token": 0.0002, "max_seqs": 8}


def _planted_run(out: Path, budget: int) -> tuple[Path, list[dict]]:
    from rich.console import Console

    from servelab.bench.run import BenchOptions, run_bench
    from servelab.bench.workloads.request_plan import LoadSpec
    from servelab.testing.testserver import Schedule, run_test_server

    sched = Schedule(steps={**PLAN, "budget": budget}, report="none", metrics="missing")
    with run_test_server(sched) as url:
        opts = BenchOptions(
            url=url,
            model="test-model",
            workload="chat",
            load=LoadSpec(concurrency=4, requests=8, length_scale=0.3),
            out=out,
            quiet=True,
            seed=1,
        )
        code = run_bench(opts, Console(file=io.StringIO(), width=160))
        truth = json.load(urllib.request.urlopen(url + "/test/steps"))
    assert code in (0, 3)  # 3: a loaded machine may mark the client invalid
    return out, truth


@pytest.fixture(scope="module")
def unchunked(tmp_path_factory):
    return _planted_run(tmp_path_factory.mktemp("twin") / "unchunked", budget=0)


@pytest.fixture(scope="module")
def chunked(tmp_path_factory):
    return _planted_run(tmp_path_factory.mktemp("twin") / "chunked", budget=64)


def _matched(inf, truth, within=0.005):
    """(inferred step, true step, the true step before it) for every true step whose tokens
    the client received within ``within`` seconds of its end."""
    ends = [s.end for s in inf.steps]
    out = []
    for k, t in enumerate(truth):
        i = bisect.bisect_left(ends, t["end"])
        if i < len(ends) and ends[i] - t["end"] < within:
            out.append((inf.steps[i], t, truth[k - 1] if k else None))
    return out


def _check_recovered(inf, truth):
    matched = _matched(inf, truth)
    visible = [t for t in truth if t["sampled"]]
    assert len(matched) >= 0.97 * len(visible)
    same = [
        (s.decode_seqs, s.prefill_tokens) == (len(t["decode"]), sum(t["prefill"].values()))
        for s, t, _ in matched
    ]
    assert sum(same) >= 0.95 * len(matched)
    timed = [
        abs((s.end - s.start) - (t["end"] - prev["end"]))
        for s, t, prev in matched
        if prev is not None and s.start is not None
    ]
    assert sum(d < 0.003 for d in timed) >= 0.9 * len(timed)


def test_step_inference_recovers_planted_batches_and_step_times(unchunked):
    path, truth = unchunked
    run = load_run(path)
    inf = infer_steps(run.records, budget=None, chunked=False)
    _check_recovered(inf, truth)
    assert max(s.decode_seqs for s in inf.steps) == 4  # the closed loop's four streams
    # The fit gives back the planted prices: a step, a decode, a prefill token.
    fit = fit_steps([inf])
    for seqs, prefill, ctx in ((1, 0, 200), (4, 0, 800), (3, 150, 600), (0, 300, 0)):
        w = step_work([])
        w.decode_seqs, w.prefill_tokens, w.kv_read = seqs, prefill, ctx
        planted = PLAN["base"] + PLAN["per_decode"] * seqs + PLAN["per_prefill_token"] * prefill
        predicted = sum(fit.coef[t] * getattr(w, t) for t in fit.coef if t != "step")
        assert predicted + fit.coef["step"] == pytest.approx(planted, rel=0.12)
    assert fit.error["median"] < 0.05


def test_chunked_prefill_pieces_and_silent_steps_are_placed(chunked):
    path, truth = chunked
    inf = infer_steps(load_run(path).records, budget=64, chunked=True)
    _check_recovered(inf, truth)
    chunks = [n for t in truth for n in t["prefill"].values()]
    assert max(chunks) <= 64 and len(chunks) > len(load_run(path).records)  # prompts were cut
    # Prefill-only steps that finish no prompt stream nothing; the inference must add as
    # many steps the client never saw.
    silent = sum(1 for t in truth if not t["sampled"])
    assert silent > 0 and abs(sum(len(s.hidden) for s in inf.steps) - silent) <= 1


def _cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "servelab.cli", *args], capture_output=True, text=True, cwd=cwd
    )


def test_calibrate_and_predict_with_ranges_from_the_cli(unchunked, tmp_path):
    path, _ = unchunked
    cal_path = tmp_path / "twin.json"
    res = _cli("calibrate", str(path), "--server-config", "srv --api-key sk-hidden-1",
               "--out", str(cal_path))  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "fit error" in res.stdout and "sk-hidden-1" not in cal_path.read_text()
    cal = TwinCalibration.load(cal_path)
    assert cal.engine_sources["max_num_seqs"].startswith("the run")
    assert cal.fit["error_on_training_steps"]["median"] < 0.05
    assert len(cal.bootstrap) > 0 and cal.noise is not None
    # the domain the run spanned: the closed loop's four streams, prompts of its lengths
    records = load_run(path).records
    assert cal.domain["in_flight"] == [1, 4] and 1 <= cal.domain["batch"][1] <= 4
    assert cal.domain["prompt_tokens"] == [
        min(r.input_tokens for r in records if r.ok),
        max(r.input_tokens for r in records if r.ok),
    ]
    out = tmp_path / "sim"
    res = _cli("sim", "--calibration", str(cal_path), "--workload", "chat", "--concurrency",
               "4", "--requests", "8", "--length-scale", "0.3", "--seed", "1", "--seeds", "3",
               "--out", str(out))  # fmt: skip
    assert res.returncode == 0, res.stderr
    pred = json.loads((out / "prediction.json").read_text())
    assert pred["seeds"] == [0, 1, 2]
    measured = json.loads((path / "metrics.json").read_text())["overall"]["latency"]
    itl = pred["figures"]["itl_p50"]
    lo, hi = itl["interval"]
    assert lo <= itl["median"] <= hi
    assert itl["median"] == pytest.approx(measured["itl"]["p50"], rel=0.25)
    man = json.loads((out / "manifest.json").read_text())
    assert man["server"]["simulated"]["cost_model"]["kind"] == "twin"
    res = _cli("sim", "--calibration", str(cal_path), "--hardware", "h100", "--workload", "chat")
    assert res.returncode != 0 and "twin calibration" in res.stderr


def test_calibrate_takes_several_runs_of_one_configuration(unchunked, tmp_path):
    import shutil

    path, _ = unchunked
    again = shutil.copytree(path, tmp_path / "again")
    cal_path = tmp_path / "twin.json"
    res = _cli("calibrate", str(path), str(again), "--out", str(cal_path))
    assert res.returncode == 0, res.stderr
    cal = TwinCalibration.load(cal_path)
    assert cal.fit["runs"] == 2 and str(again) in cal.run
    one = json.loads((path / "manifest.json").read_text())
    assert cal.fit["inference"]["requests"] == 2 * len(load_run(path).records)
    other = shutil.copytree(path, tmp_path / "other")
    one["server"]["stated_command"] = ["vllm", "serve", "m", "--max-num-seqs", "2"]
    (other / "manifest.json").write_text(json.dumps(one))
    res = _cli("calibrate", str(path), str(other), "--out", str(tmp_path / "no.json"))
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "another server configuration" in res.stderr and "max_num_seqs" in res.stderr


# ----------------------------------------------------------------- the server's settings


def test_flags_parse_and_render_in_each_servers_spelling():
    vllm = "vllm serve m --max-num-batched-tokens=512 --no-enable-prefix-caching --max-num-seqs 8"
    assert parse_flags("vllm", vllm) == {
        "max_num_batched_tokens": 512,
        "enable_prefix_caching": False,
        "max_num_seqs": 8,
    }
    sg = ["python", "-m", "sglang.launch_server", "--chunked-prefill-size", "-1",
          "--disable-radix-cache", "--max-running-requests", "32"]  # fmt: skip
    assert parse_flags("sglang", sg) == {
        "enable_chunked_prefill": False,
        "enable_prefix_caching": False,
        "max_num_seqs": 32,
    }
    assert parse_flags("llamacpp", "llama-server -m x -b 256 -np 4 -c 8192") == {
        "max_num_batched_tokens": 256,
        "max_num_seqs": 4,
        "kv_tokens": 8192,
    }
    change = {"enable_chunked_prefill": True, "max_num_batched_tokens": 512}
    assert render_flags("vllm", change) == "--enable-chunked-prefill --max-num-batched-tokens 512"
    assert render_flags("sglang", change) == "--chunked-prefill-size 512"
    assert render_flags("sglang", {"enable_chunked_prefill": False}) == "--chunked-prefill-size -1"
    assert render_flags("llamacpp", {"max_num_seqs": 2}) == "--parallel 2"
    assert parse_flags("llamacpp", "llama-server --no-cache-prompt") == {
        "enable_prefix_caching": False
    }
    assert render_flags("llamacpp", {"enable_prefix_caching": False}) == "--no-cache-prompt"
    with pytest.raises(ValueError, match="no launch flag for enable_chunked_prefill"):
        render_flags("llamacpp", {"enable_chunked_prefill": False})
    # Rendered flags read back as the same settings.
    for kind in ("vllm", "sglang"):
        assert parse_flags(kind, render_flags(kind, change)) == change


def _vllm_run(tmp_path, **server):
    path = rundirs.as_other_target(rundirs.unchunked_stalls(tmp_path / "v"), figures=True)
    man = json.loads((path / "manifest.json").read_text())
    man["server"].update(server)
    (path / "manifest.json").write_text(json.dumps(man))
    return path


def test_settings_come_from_the_server_then_its_command_then_defaults(tmp_path):
    path = _vllm_run(
        tmp_path,
        models=[{"id": "m", "owned_by": "vllm", "max_model_len": 4096}],
        info_metrics={"vllm:cache_config_info": {"block_size": "128", "num_gpu_blocks": "364"}},
        stated_command=["vllm", "serve", "m", "--no-enable-chunked-prefill", "--block-size", "16"],
    )
    s = server_settings(load_run(path))
    assert s.kind == "vllm"
    assert s.values["block_size"] == 128 and "/metrics" in s.sources["block_size"]
    assert s.values["num_kv_blocks"] == 364 and s.values["max_model_len"] == 4096
    assert s.values["enable_chunked_prefill"] is False
    assert "stated" in s.sources["enable_chunked_prefill"]
    assert s.values["enable_prefix_caching"] is True and s.stated("enable_prefix_caching") is None
    # Given now, a stated config fills what the run did not record.
    s = server_settings(load_run(path), "vllm serve m --max-num-seqs 16")
    assert s.values["max_num_seqs"] == 16


def test_a_vllm_run_without_chunking_is_told_to_turn_it_on(tmp_path):
    # The case: stalls behind long prefills on vLLM started with
    # --no-enable-chunked-prefill. Told so, the first move is chunking, in vLLM's flags.
    unknown = diagnose(load_run(_vllm_run(tmp_path / "a")))
    stated = diagnose(
        load_run(
            _vllm_run(
                tmp_path / "b",
                stated_command=["vllm", "serve", "m", "--no-enable-chunked-prefill"],
            )
        )
    )
    launched = diagnose(
        load_run(
            _vllm_run(
                tmp_path / "c",
                launched=True,
                command=["vllm", "serve", "m", "--port", "8001", "--no-enable-chunked-prefill"],
            )
        )
    )
    assert "batch_budget_down" in {r.lever for r in unknown.recommendations}
    for d in (stated, launched):
        f = {f.id: f for f in d.findings}["itl_prefill_interference"]
        assert f.evidence["chunked_prefill"] is False and "chunked_prefill" in f.levers
        recs = {r.lever: r.action for r in d.recommendations}
        assert recs["chunked_prefill"] == (
            "vllm serve --enable-chunked-prefill --max-num-batched-tokens 2048"
        )
        assert "batch_budget_down" not in recs


def _calibration(**kw):
    base = {
        "server": "vllm",
        "model": "smollm2-135m",
        "engine_config": {
            "max_num_batched_tokens": 2048,
            "max_num_seqs": 128,
            "enable_chunked_prefill": True,
            "block_size": 128,
            "max_model_len": 8192,
            "num_kv_blocks": 364,
        },
        "engine_sources": {},
        "max_model_len": 8192,
        "kv_bytes_per_token": 1.0,
        "cost": {"step": 0.02, "decode_seqs": 0.001, "prefill_tokens": 0.0002},
        "bootstrap": [{"step": 0.021, "decode_seqs": 0.001, "prefill_tokens": 0.0002}],
        "noise": None,
        "api_overhead_s": 0.01,
        "fit": {},
        "speed_spread": 0.2,
    }
    return TwinCalibration(**{**base, **kw})


def test_a_servers_flags_become_the_twins_engine_changes():
    from servelab.sim.fit.twin import flag_changes

    cal = _calibration()
    assert flag_changes(cal, "--no-enable-chunked-prefill") == {
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 8192,  # vLLM computes an unchunked prompt in one step
    }
    assert flag_changes(cal, "--max-num-batched-tokens 256 --no-enable-prefix-caching") == {
        "max_num_batched_tokens": 256,
        "enable_prefix_caching": False,
    }
    unchunked = _calibration(
        engine_config={**cal.engine_config, "enable_chunked_prefill": False,
                       "max_num_batched_tokens": 8192}, hardware="cpu"
    )  # fmt: skip
    assert flag_changes(unchunked, "--enable-chunked-prefill") == {
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": 2048,  # the CPU build's default budget, not the context
    }


def test_seed_zero_is_the_fit_and_later_seeds_draw_a_refit_and_a_speed():
    cal = _calibration()
    t0, t1, t2 = cal.target(0), cal.target(1), cal.target(2)
    assert t0.info["speed_factor"] == 1.0 and t0.cost_model.coef["step"] == 0.02
    assert t1.info["speed_factor"] != 1.0 != t2.info["speed_factor"]
    assert t1.cost_model.coef["step"] == pytest.approx(0.021 * t1.info["speed_factor"])
    assert cal.target(1).cost_model.coef == t1.cost_model.coef  # deterministic per seed
    assert t0.engine_config.block_size == 128 and t0.engine_config.num_kv_blocks == 364


def test_the_speed_factor_carries_the_forms_error_beside_the_drift():
    cal = _calibration(speed_spread=None, form_spread=0.2)
    assert cal.target(0).info["speed_factor"] == 1.0
    assert cal.target(1).info["speed_factor"] != 1.0
    assert _calibration(speed_spread=None).target(1).info["speed_factor"] == 1.0


def test_form_spread_is_the_forms_error_on_the_load_it_was_not_fitted_on():
    import numpy as np

    from servelab.sim.fit.twin import MIN_ROWS, form_spread

    decodes = np.repeat(np.arange(1, 9), 10).astype(float)
    a = np.zeros((len(decodes), 6))
    a[:, 0], a[:, 1] = 1.0, decodes
    assert form_spread(a, 0.02 + 0.001 * decodes) == pytest.approx(0.0, abs=1e-6)
    # a decode price that grows with the batch: each half's line misprices the other's steps
    assert form_spread(a, 0.02 + 0.0005 * decodes**2) > 0.1
    # a closed loop's heavier half, all at its concurrency (4): only the lighter half's
    # line prices, and the step that costs more at 4 than the line says is its error
    closed = np.concatenate([np.repeat([1.0, 2.0, 3.0], 10), np.full(40, 4.0)])
    closed_a = np.zeros((len(closed), 6))
    closed_a[:, 0], closed_a[:, 1] = 1.0, closed
    step_up = np.where(closed < 4, 0.02, 0.03) + 0.001 * closed
    assert form_spread(closed_a, step_up) == pytest.approx(math.log(0.034 / 0.024), rel=1e-3)
    lopsided = a[: MIN_ROWS + MIN_ROWS - 1]  # the heavier half one row short
    lopsided[MIN_ROWS:, 1] = 2.0
    lopsided[:MIN_ROWS, 1] = 1.0
    assert form_spread(lopsided, 0.02 + 0.001 * lopsided[:, 1]) is None


def test_the_api_time_leaves_out_the_wait_for_the_step_in_progress():
    from types import SimpleNamespace

    from servelab.sim.fit.twin import reported_api_overhead

    def rec(send, scheduled, prefill=0.03):
        # the server's figures: no queue, prefill from its scheduling to the first token
        return SimpleNamespace(
            ok=True, actual_send=send, ttft=scheduled + prefill - send,
            server_timeline={"queue_time": 0.0, "prefill_time": prefill},
        )  # fmt: skip

    ends = [1.000, 1.040, 2.000, 2.040, 3.000, 3.040]
    # each reached the engine 10 ms after its send, during the step ending at x.040, and
    # was scheduled there: its 40 ms of TTFT before scheduling hold 10 ms of way in and a
    # wait the estimate puts at half the 40 ms step
    busy = SimpleNamespace(records=[rec(t, t + 0.040) for t in (1.0, 2.0, 3.0)])
    assert reported_api_overhead([busy], [ends]) == pytest.approx(0.040 - 0.020)
    # an idle engine (no step ends near the scheduling moment) takes a request at once
    idle = SimpleNamespace(records=[rec(t, t + 0.010) for t in (1.5, 2.5, 3.5)])
    assert reported_api_overhead([idle], [ends]) == pytest.approx(0.010)


def test_several_runs_put_the_drift_between_them_into_the_speed_spread():
    from servelab.analyze.server_side.stepinfer import InferredStep, SeqWork, StepInference

    def run(speed):
        """30 s of back-to-back steps of 1-4 decodes priced 20 ms + 3 ms a decode, / speed."""
        steps, t = [], 0.0
        for k in range(1500):
            n = 1 + k % 4
            seqs = [SeqWork(f"r{i}", 1, 100, True) for i in range(n)]
            dur = (0.02 + 0.003 * n) / speed
            steps.append(InferredStep(end=t + dur, start=t, arrival=None, seqs=seqs))
            t += dur
        return StepInference(steps, 0.001, {}, {})

    alone = fit_steps([run(1.0)])
    assert alone.speed_spread == pytest.approx(0.0, abs=1e-6)
    both = fit_steps([run(1.0), run(0.8)])  # relaunched 25% slower
    assert both.speed_spread == pytest.approx(math.log(1.25) / 2, rel=0.1)
    assert 0.02 < both.coef["step"] < 0.025  # between the two runs' prices


def test_the_step_inference_figures_of_several_runs_add_up():
    from servelab.sim.fit.twin import _merged

    a = {"steps": 100, "max_batch": 4, "mean_batch": 2.0, "tolerance_s": 0.002,
         "running_vs_batch_mean": [2.0, 2.5]}  # fmt: skip
    b = {"steps": 300, "max_batch": 3, "mean_batch": 3.0, "tolerance_s": 0.004}
    m = _merged([a, b], [100, 300])
    assert m["steps"] == 400 and m["max_batch"] == 4 and m["tolerance_s"] == 0.004
    assert m["mean_batch"] == pytest.approx(2.75)
    assert m["running_vs_batch_mean"] == [2.0, 2.5]  # only the run that had it


def _slowed(path: Path, out: Path, factor: float) -> Path:
    """A copy of a run whose client saw everything ``factor`` times slower (its
    ``metrics.json`` summarised again from the slowed records)."""
    import shutil

    from servelab.analyze.summary import summarize

    shutil.copytree(path, out)
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    t0 = min(r["actual_send"] for r in rows)
    keys = ("intended_send", "actual_send", "first_byte", "done", "first_output", "connected",
            "request_written")  # fmt: skip
    for r in rows:
        for k in keys:
            if isinstance(r.get(k), (int, float)):
                r[k] = t0 + factor * (r[k] - t0)
        r["chunk_times"] = [t0 + factor * (t - t0) for t in r["chunk_times"]]
    (out / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = summarize(load_run(out).records, n_boot=0)
    (out / "metrics.json").write_text(json.dumps(metrics))
    return out


def test_a_launchs_step_speed_is_its_steps_against_the_twin(unchunked, tmp_path):
    from benchmarks.sim.twin_check import step_speed
    from servelab.sim.fit.twin import calibrate_runs

    path, _ = unchunked
    twin = calibrate_runs([load_run(path)]).save(tmp_path / "twin.json")
    assert step_speed(twin, path) == pytest.approx(1.0, abs=0.05)
    slow = _slowed(path, tmp_path / "slow", 1.25)  # the same run on a launch 25% slower
    assert step_speed(twin, slow) == pytest.approx(1.25, abs=0.07)


def test_intervals_come_from_replaying_runs_the_twin_was_not_fitted_on(unchunked, tmp_path):
    import shutil

    from servelab.sim.fit.held_out import MIN_FIGURE_ERRORS, calibrate_twin, fold_errors
    from servelab.sim.fit.twin import calibrate_runs

    path, _ = unchunked
    run = load_run(path)
    assert calibrate_twin([run]).intervals is None  # one run: nothing held out
    # A run 30% slower than the other: each, replayed on the twin of the other, decodes
    # about 1.3 times off, the fast one high and the slow one low. (The fast run's sends on
    # the slow twin overlap more, so its batches grow and its error is a little larger.)
    slow = load_run(_slowed(path, tmp_path / "slow", 1.3))
    errors = fold_errors([run, slow], lambda others: calibrate_runs(others))
    decode = {(r, f): e for r, f, e in errors if f in ("itl_p50", "tpot_p50")}
    assert len(decode) == 4
    for (name, _), e in decode.items():
        assert (e > 0) == (name == str(run.path))
        assert math.log(1.15) < abs(e) < math.log(1.6), (name, e)
    cal = calibrate_twin([run, slow])
    got = cal.intervals
    assert got is not None and got["runs"] == 2
    # queueing amplifies the step's 30% in the TTFT tail: the pooled width is at least it
    assert math.log(1.25) < got["80"] < math.log(3) and got["95"] >= got["80"]
    assert "leave-one-run-out" in got["derived"] and len(got["errors"]) == len(errors)
    # two errors a figure, fewer than MIN_FIGURE_ERRORS: every figure takes the pooled width
    assert MIN_FIGURE_ERRORS > 2 and got["figures"] == {}
    assert cal.target(0).info["intervals"] == got
    # identical runs: the replays' own error, far inside the slowed pair's
    same = calibrate_twin([run, load_run(shutil.copytree(path, tmp_path / "same"))]).intervals
    assert same is not None and same["80"] < got["80"] / 2


def test_a_figure_has_its_own_width_with_enough_errors_else_the_pooled_one():
    from servelab.sim.fit.held_out import MIN_FIGURE_ERRORS, half_widths

    n = MIN_FIGURE_ERRORS
    slow = math.log(1.3)
    errors = [(f"run{k}", "itl_p50", slow * (-1) ** k) for k in range(n)]
    errors += [(f"run{k}", "ttft_p90", 0.05 * k) for k in range(n - 1)]
    got = half_widths(errors, n)
    assert got is not None and set(got["figures"]) == {"itl_p50"}
    own = got["figures"]["itl_p50"]
    assert own["80"] == pytest.approx(slow) and own["95"] == pytest.approx(slow)
    assert own["n"] == n
    # ttft_p90 has n - 1 errors: it falls back to the pooled quantiles over all 2n - 1
    sizes = sorted([slow] * n + [0.05 * k for k in range(n - 1)])
    assert got["80"] == pytest.approx(float(np.quantile(sizes, 0.8)))
    assert got["95"] == pytest.approx(float(np.quantile(sizes, 0.95)))
    assert got["errors"][0] == {"run": "run0", "figure": "itl_p50", "error": round(slow, 5)}
    assert half_widths(errors[:2], 2) is None  # too few errors to state anything


def test_a_held_out_parts_twin_infers_steps_from_every_stream_and_fits_its_own_windows(unchunked):
    import dataclasses

    from servelab.sim.fit.asrun import fold_replica, folds
    from servelab.sim.fit.twin import calibrate_runs

    run = load_run(unchunked[0])
    whole = calibrate_runs([run])
    assert calibrate_runs([run], fits=lambda t: True).cost == whole.cost
    with pytest.raises(ValueError, match="could be timed"):
        calibrate_runs([run], fits=lambda t: False)  # no window to fit: no row
    parts = folds(run)
    twins = [fold_replica(run, p).twin for p in parts]
    assert all(t is not None for t in twins)
    for part, cal in zip(parts, twins):
        # The steps are the whole run's, inferred from every stream: the held-out streams
        # still ran in the batches of the fitting windows' steps.
        assert cal.fit["inference"] == whole.fit["inference"]
        assert cal.engine_config == whole.engine_config
        alone = [r for r in run.records if r.request_id not in part.held_out]
        half = calibrate_runs([dataclasses.replace(run, records=alone, derived={})])
        assert half.fit["inference"]["requests"] < whole.fit["inference"]["requests"]
        # Fitted to its own windows' steps only, and the planted prices come back from them.
        assert 0 < cal.fit["rows"] < whole.fit["rows"]
        assert cal.cost["decode_seqs"] == pytest.approx(PLAN["per_decode"], rel=0.15)
        assert cal.cost["prefill_tokens"] == pytest.approx(PLAN["per_prefill_token"], rel=0.15)
    # Each step's row is in exactly one part's fitting windows.
    assert sum(t.fit["rows"] for t in twins) == whole.fit["rows"]
