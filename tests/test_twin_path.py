"""One path for a twin's predictions: `sim --calibration` reads the server's own flags, plans
prompts with the twin's tokenizer (or says it cannot), replays a run directory as its trace,
warns outside the twin's calibrated domain, and carries intervals derived out of sample."""

from __future__ import annotations

import json

import pytest

from servelab.sim.fit.twin import TwinCalibration, server_engine_args


def _twin(server: str = "vllm", **kw) -> TwinCalibration:
    base = {
        "server": server,
        "model": "smollm2-135m",
        "engine_config": {
            "max_num_batched_tokens": 2048,
            "max_num_seqs": 128,
            "enable_chunked_prefill": True,
            "block_size": 16,
            "max_model_len": 8192,
            "num_kv_blocks": 4096,
        },
        "engine_sources": {},
        "max_model_len": 8192,
        "kv_bytes_per_token": 1.0,
        "cost": {"step": 0.02, "decode_seqs": 0.001, "prefill_tokens": 0.0002},
        "bootstrap": [{"step": 0.021, "decode_seqs": 0.001, "prefill_tokens": 0.0002}],
        "noise": None,
        "api_overhead_s": 0.01,
        "fit": {},
    }
    return TwinCalibration(**{**base, **kw})


# ------------------------------------------------------------ engine args, the server's way


def test_a_vllm_twin_reads_vllms_flags_as_vllm_means_them():
    twin = _twin()
    # vLLM without chunking computes a prompt in one step: the budget becomes the context.
    assert server_engine_args(twin, "--no-enable-chunked-prefill --max-num-seqs=8") == {
        "enable_chunked_prefill": False,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 8192,
    }
    assert server_engine_args(twin, "--num-gpu-blocks-override 100") == {"num_kv_blocks": 100}
    with pytest.raises(ValueError, match="twin is of vllm.*--max-num-seqs"):
        server_engine_args(twin, "--chunked-prefill-size 512")
    with pytest.raises(ValueError, match="twin is of vllm"):
        server_engine_args(twin, "max_num_seqs=8")
    with pytest.raises(ValueError, match="give it a value"):
        server_engine_args(twin, "--max-num-seqs")


def test_sglang_and_llama_server_twins_read_their_own_flags():
    sg = _twin("sglang")
    assert server_engine_args(sg, "--chunked-prefill-size -1 --disable-radix-cache") == {
        "enable_chunked_prefill": False,
        "enable_prefix_caching": False,
    }
    assert server_engine_args(sg, "--max-running-requests 4") == {"max_num_seqs": 4}
    llama = _twin("llamacpp")
    assert server_engine_args(llama, "-np 2 -b 256 --ctx-size 1600") == {
        "max_num_seqs": 2,
        "max_num_batched_tokens": 256,
        "num_kv_blocks": 100,  # 1600 tokens in blocks of 16
    }
    with pytest.raises(ValueError, match="twin is of llamacpp"):
        server_engine_args(llama, "--max-num-seqs 2")


def test_sim_applies_a_twins_flags_in_its_servers_spelling(tmp_path):
    from servelab.sim.run import sim_target, twin_engine_args
    from servelab.sim.spec import TargetSpec

    path = _twin().save(tmp_path / "twin.json")
    target = sim_target(
        TargetSpec(calibration=str(path), engine_args="--no-enable-chunked-prefill")
    )
    cfg = target.engine_config
    assert cfg.enable_chunked_prefill is False and cfg.max_num_batched_tokens == 8192
    # A twin of a server servelab has no flag table for keeps servelab's own spelling.
    other = _twin("other")
    assert twin_engine_args(other, "--max-num-seqs 4") == {"max_num_seqs": 4}
    with pytest.raises(ValueError, match="drop tp"):
        twin_engine_args(other, "--tp 2")


# ------------------------------------------------------------ tokens, the twin's model's


def _sim(tmp_path, twin: TwinCalibration, *extra: str) -> tuple[int, str, str]:
    import subprocess
    import sys

    path = twin.save(tmp_path / "twin.json")
    res = subprocess.run(
        [sys.executable, "-m", "servelab.cli", "sim", "--calibration", str(path),
         "--out", str(tmp_path / "sim"), *extra],
        capture_output=True, text=True,
    )  # fmt: skip
    return res.returncode, res.stdout, res.stderr


def test_a_twin_plans_with_its_models_tokenizer_or_says_it_cannot(tmp_path):
    from servelab.sim.run import planning_tokenizer

    tok, note = planning_tokenizer(_twin(tokenizer="smollm2-135m").target())
    assert tok is not None and tok.name == "smollm2-135m" and note is None
    tok, note = planning_tokenizer(_twin(model="org/Big-70B").target())
    assert tok is None and "'org/Big-70B'" in note and "by token length" in note
    load = ("--workload", "chat", "--concurrency", "2", "--requests", "4", "--no-steps")
    code, out, err = _sim(tmp_path, _twin(model="org/Big-70B"), *load)
    assert code == 0, err
    assert "no tokenizer 'org/Big-70B' here" in out
    assert all(len(line) <= 100 for line in out.splitlines())


def test_calibration_records_the_tokenizer_that_counted_the_models_tokens():
    from types import SimpleNamespace

    from servelab.sim.fit.twin import run_tokenizer

    def run(**manifest):
        return SimpleNamespace(manifest=manifest)

    assert run_tokenizer(run(tokenizer="org/M", tokenizer_source="--tokenizer"), "m") == "org/M"
    # servelab's default tokenizer stood in for the model's: the model names it
    assert (
        run_tokenizer(run(tokenizer="smollm2-135m", tokenizer_source="default model"), "m") == "m"
    )
    assert run_tokenizer(run(), "m") == "m"


# ------------------------------------------------------------ a run directory as the trace


def test_a_simulated_run_replays_as_planned_through_sim_trace(tmp_path):
    load = ("--hardware", "h100", "--model", "smollm2-135m", "--no-steps")
    first = _cli_sim(tmp_path / "a", *load, "--workload", "rag", "--rate", "4",
                     "--requests", "12", "--seed", "3")  # fmt: skip
    again = _cli_sim(tmp_path / "b", *load, "--trace", str(tmp_path / "a"))
    a, b = _records(tmp_path / "a"), _records(tmp_path / "b")
    assert first.returncode == 0 == again.returncode, again.stderr
    assert [(r.input_tokens, r.output_tokens) for r in a] == [
        (r.input_tokens, r.output_tokens) for r in b
    ]
    assert [r.intended_send - a[0].intended_send for r in a] == pytest.approx(
        [r.intended_send - b[0].intended_send for r in b], abs=1e-6
    )
    man = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert man["sim"]["trace"]["replayed"].startswith("as planned")
    res = _cli_sim(tmp_path / "c", *load, "--trace", str(tmp_path / "a"), "--rate", "8")
    assert res.returncode != 0 and "drop --rate" in res.stderr and "Traceback" not in res.stderr


def test_an_imported_run_replays_its_sends_lengths_and_cache_hits(tmp_path):
    import rundirs

    from servelab.bench.workloads.request_plan import LoadSpec
    from servelab.rundir import load_run
    from servelab.sim.scenario import requests_from_run

    path = rundirs.as_other_target(rundirs.shared_prefix(tmp_path / "r"), figures=True)
    rows = [json.loads(line) for line in (path / "requests.jsonl").read_text().splitlines()]
    seen: set[str] = set()
    for row in rows:  # the server reports 256 cached tokens for each repeat of a prefix
        row["cached_tokens"] = 256 if row["prefix_group"] in seen else 0
        seen.add(row["prefix_group"])
    (path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = load_run(path)
    got = requests_from_run(str(path), _twin().target(), LoadSpec(trace=str(path)))
    assert got.info["trace"]["replayed"].startswith("from its records")
    assert "replays from its records" in got.info["notes"][0]
    recs = sorted((r for r in run.records if r.ok), key=lambda r: r.actual_send)
    assert [q.request_id for q in got.requests] == [r.request_id for r in recs]
    assert [len(q.prompt_token_ids) for q in got.requests] == [r.input_tokens for r in recs]
    assert [q.send_time for q in got.requests] == pytest.approx(
        [r.actual_send - recs[0].actual_send for r in recs]
    )
    by_group: dict[str, list] = {}
    for q in got.requests:
        by_group.setdefault(q.tags.prefix_group, []).append(q.prompt_token_ids)
    first, second, *_ = next(g for g in by_group.values() if len(g) > 1)
    assert first[:256] == second[:256] and first[:259] != second[:259]
    others = [g[0] for g in by_group.values()]
    assert others[0][:3] != others[1][:3]  # no two groups share a block
    assert got.max_concurrency is None  # the run's load is open: nothing holds a send back


@pytest.mark.parametrize(("load", "held"), [({"concurrency": 2}, 2), ({"rate": 4.0}, None)])
def test_a_closed_loop_replayed_from_records_stays_closed(tmp_path, load, held):
    # a ladder rung planned with the server's /tokenize replays from its records: on a twin
    # slower than the server, a closed loop of one must not send its next request before
    # the last one ends (that stall was one rung's whole ITL p99)
    import rundirs

    from servelab.bench.workloads.request_plan import LoadSpec
    from servelab.sim.scenario import requests_from_run

    path = rundirs.as_other_target(rundirs.shared_prefix(tmp_path / "r"), figures=True)
    man = json.loads((path / "manifest.json").read_text())
    man.setdefault("config", {})["load"] = {"concurrency": None, "rate": None, **load}
    (path / "manifest.json").write_text(json.dumps(man))
    got = requests_from_run(str(path), _twin().target(), LoadSpec(trace=str(path)))
    assert got.info["trace"]["replayed"].startswith("from its records")
    assert got.max_concurrency == held


def _cli_sim(out, *args):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "servelab.cli", "sim", "--out", str(out), *args],
        capture_output=True,
        text=True,
    )


def _records(run_dir):
    from servelab.rundir import load_run

    return sorted(load_run(run_dir).records, key=lambda r: r.intended_send)


# ------------------------------------------------------------ the twin's domain


def _rec(i, send, done, prompt, output):
    from servelab.vocab import ClientRecord

    return ClientRecord(
        request_id=f"r{i}", intended_send=send, actual_send=send, done=done,
        input_tokens=prompt, output_tokens=output, workload_class="chat",
    )  # fmt: skip


def test_the_domain_is_what_the_runs_spanned_and_sim_says_how_far_past_it():
    from servelab.sim.fit.twin import domain_of, outside_domain

    recs = [_rec(0, 0.0, 2.0, 100, 10), _rec(1, 1.0, 3.0, 300, 50), _rec(2, 2.5, 4.0, 200, 20)]
    dom = domain_of(recs)
    assert dom == {"prompt_tokens": [100, 300], "output_tokens": [10, 50], "in_flight": [1, 2]}
    assert outside_domain(dom, recs) is None
    assert outside_domain(None, recs) is None
    wider = [_rec(k, 0.0, 5.0, 1200, 20) for k in range(4)] + [_rec(9, 0.0, 1.0, 25, 20)]
    line = outside_domain(dom, wider)
    assert line == (
        "warning: beyond the twin's domain: prompt 1200 vs <= 300 (4.0x); "
        "also prompt 4.0x, in flight 2.5x"
    )
    assert len(line) <= 100


def test_sim_warns_when_a_twins_scenario_leaves_its_domain(tmp_path):
    domain = {"prompt_tokens": [50, 400], "output_tokens": [1, 400], "in_flight": [1, 2]}
    load = ("--workload", "chat", "--concurrency", "8", "--requests", "8", "--no-steps")
    code, out, err = _sim(tmp_path, _twin(domain=domain), *load)
    assert code == 0, err
    assert "warning: beyond the twin's domain:" in out and "in flight 8 vs <= 2 (4.0x)" in out


# ------------------------------------------------------------ intervals out of sample


def test_a_prediction_states_the_twins_out_of_sample_intervals(tmp_path):
    import math

    from servelab.sim.intervals import FigureRanges

    pred = FigureRanges([0, 1], [{"ttft_p50": 0.1}, {"ttft_p50": 0.3}], {"80": 0.1, "95": 0.5})
    assert pred.levels("ttft_p50")["80"] == pytest.approx(
        (0.2 / math.exp(0.1), 0.2 * math.exp(0.1))
    )
    assert pred.levels("itl_p50") == {}
    assert (
        "intervals" not in FigureRanges([0], [{"ttft_p50": 0.1}]).to_dict()["figures"]["ttft_p50"]
    )
    stated = {"80": 0.1, "95": 0.3, "errors": [0.1, -0.2, 0.05], "runs": 2, "derived": "x"}
    load = ("--workload", "chat", "--concurrency", "2", "--requests", "4", "--seeds", "2")
    code, out, err = _sim(tmp_path, _twin(intervals=stated), *load)
    assert code == 0, err
    doc = json.loads((tmp_path / "sim" / "prediction.json").read_text())
    itl = doc["figures"]["itl_p50"]
    lo, hi = itl["intervals"]["95"]
    assert lo == pytest.approx(itl["median"] * math.exp(-0.3))
    assert hi == pytest.approx(itl["median"] * math.exp(0.3))
    assert doc["half_widths"] == {"80": 0.1, "95": 0.3}
    line = next(x for x in out.splitlines() if x.startswith("80% and 95%"))
    assert "a factor 1.11 and 1.35 either side of the median" in line and len(line) <= 100
    assert itl["intervals_from"] == "pooled" and "figure_half_widths" not in doc


def test_a_prediction_uses_a_figures_own_width_where_the_twin_has_one(tmp_path):
    import math

    own = {"itl_p50": {"80": 0.2, "95": 0.4, "n": 9}}
    stated = {"80": 0.1, "95": 0.3, "figures": own, "errors": [], "runs": 9, "derived": "x"}
    load = ("--workload", "chat", "--concurrency", "2", "--requests", "4", "--seeds", "2")
    code, out, err = _sim(tmp_path, _twin(intervals=stated), *load)
    assert code == 0, err
    doc = json.loads((tmp_path / "sim" / "prediction.json").read_text())
    itl, ttft = doc["figures"]["itl_p50"], doc["figures"]["ttft_p50"]
    assert itl["intervals"]["95"][1] == pytest.approx(itl["median"] * math.exp(0.4))
    assert itl["intervals"]["80"][0] == pytest.approx(itl["median"] * math.exp(-0.2))
    assert ttft["intervals"]["95"][1] == pytest.approx(ttft["median"] * math.exp(0.3))
    assert (itl["intervals_from"], ttft["intervals_from"]) == ("figure", "pooled")
    assert doc["figure_half_widths"] == {"itl_p50": {"80": 0.2, "95": 0.4}}
    assert doc["half_widths"] == {"80": 0.1, "95": 0.3}
    lines = out.splitlines()
    line = next(x for x in lines if x.startswith("80% and 95%"))
    assert "(leave-one-run-out): 1 of 10 figures' own, else pooled x1.11 / x1.35" in line
    row = next(x for x in lines if "itl_p50" in x)
    assert "x1.22 / x1.49" in row and "its own" in row
    assert "x1.11 / x1.35" in next(x for x in lines if "ttft_p50" in x)
    assert all(len(x) <= 100 for x in lines)


def test_twin_check_reports_coverage_and_width_from_run_directories(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from servelab.sim.intervals import FIGURES

    def pair(k: int, measured: float) -> str:
        pred, real = tmp_path / f"sim{k}", tmp_path / f"real{k}"
        pred.mkdir()
        real.mkdir()
        figures = {
            name: {"median": 1.0, "interval": [0.95, 1.05],
                   "intervals": {"80": [0.9, 1.1], "95": [0.8, 1.25]}}
            for name, _, _ in FIGURES
        }  # fmt: skip
        (pred / "prediction.json").write_text(json.dumps({"figures": figures}))
        stats = ("mean", "p50", "p90", "p99")
        lat = {m: {p: measured for p in stats} for m in ("ttft", "itl", "tpot", "e2e")}
        overall = {"latency": lat, "throughput": {"output_tokens_per_s": measured}}
        (real / "metrics.json").write_text(json.dumps({"overall": overall}))
        return f"{pred}:{real}"

    repo = Path(__file__).resolve().parents[1]
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.sim.twin_check", "coverage",
         pair(0, 1.0), pair(1, 1.2), pair(2, 1.5)],
        capture_output=True, text=True, cwd=repo,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.splitlines()[-1])
    n = 3 * len(FIGURES)
    assert got["seeds range"] == {
        "figures": n,
        "coverage": pytest.approx(1 / 3),
        "median_width": pytest.approx(0.1),
    }
    assert got["80"]["coverage"] == pytest.approx(1 / 3)
    assert got["95"]["coverage"] == pytest.approx(2 / 3)
    assert got["95"]["median_width"] == pytest.approx(0.45)
    bad = subprocess.run(
        [sys.executable, "-m", "benchmarks.sim.twin_check", "coverage", "nope"],
        capture_output=True, text=True, cwd=repo,
    )  # fmt: skip
    assert bad.returncode != 0 and "PRED_DIR:RUN_DIR" in bad.stderr


def test_a_sweep_over_a_twin_means_what_the_servers_flags_mean(tmp_path):
    from servelab.sim.run import point_changes
    from servelab.sim.spec import TargetSpec

    spec = TargetSpec(calibration=str(_twin().save(tmp_path / "twin.json")))
    assert point_changes(spec, {"enable_chunked_prefill": False}) == {
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 8192,
    }
    llama = TargetSpec(calibration=str(_twin("llamacpp").save(tmp_path / "llama.json")))
    with pytest.raises(ValueError, match="llamacpp has no launch flag"):
        point_changes(llama, {"enable_chunked_prefill": False})
    assert point_changes(TargetSpec(hardware="h100"), {"max_num_seqs": 4}) == {"max_num_seqs": 4}
