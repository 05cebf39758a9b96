"""The other tools' runs of benchmarks/sim/twin_tools.py without a server: the pre-registered
run list's invariants, each tool's command carrying the run's load, lengths, seed and output
file, and the scores on small synthetic prediction.json / metrics.json directories."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from test_twin_protocol import _write_pred, _write_run

from benchmarks.peers.clients import Tokenizer, clients
from benchmarks.sim import twin_tools as tt
from benchmarks.sim.twin_vllm import SERVED


def test_the_pre_registered_runs_hold_one_training_run_and_two_held_out_at_new_load_and_lengths():
    assert tt.run_problems(tt.RUNS) == []
    train = [r for r in tt.RUNS if r.train]
    held = [r for r in tt.RUNS if not r.train]
    assert len(train) == 1 and len(held) >= 2
    t = train[0]
    assert any(r.streams != t.streams for r in held)
    assert any(
        (r.prompt_tokens, r.output_tokens) != (t.prompt_tokens, t.output_tokens) for r in held
    )
    assert len({r.seed for r in tt.RUNS}) == len(tt.RUNS)


def test_a_run_list_short_of_the_invariants_is_named():
    t, a, b = tt.RUNS
    same_load = replace(a, streams=t.streams)
    same_lengths = replace(b, prompt_tokens=t.prompt_tokens, output_tokens=t.output_tokens)
    problems = tt.run_problems([t, same_load, replace(same_lengths, streams=t.streams)])
    assert "no held-out run at another load" in problems
    assert "no held-out run of other lengths" in problems
    assert "1 held-out runs, want 2 or more" in tt.run_problems([t, a])
    assert "seed 1 is given to several runs" in tt.run_problems([t, a, replace(b, seed=1)])
    assert "0 training runs, want 1" in tt.run_problems([a, b])


def _value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


@pytest.mark.parametrize("r", tt.RUNS, ids=lambda r: r.slug)
def test_each_tool_s_command_carries_the_run_s_load_lengths_seed_and_output_file(tmp_path, r):
    tok = Tokenizer(tmp_path / "tok", tmp_path / "hub")
    by_name = {c.name: c for c in clients(tmp_path)}
    url = "http://127.0.0.1:9"
    cmds = {t: by_name[t].command(tt.job(t, r, url), tok, tmp_path / t) for t in tt.TOOLS}

    v = cmds["vllm"]
    assert _value(v, "--max-concurrency") == str(r.streams)
    assert _value(v, "--request-rate") == "inf"  # a closed loop: its concurrency is the load
    assert _value(v, "--num-prompts") == str(r.requests)
    assert _value(v, "--random-input-len") == str(r.prompt_tokens)
    assert _value(v, "--random-output-len") == str(r.output_tokens)
    assert _value(v, "--seed") == str(r.seed)
    assert _value(v, "--model") == SERVED
    assert "--save-detailed" in v and "--ignore-eos" in v
    assert _value(v, "--result-filename") == by_name["vllm"].result
    assert _value(v, "--result-dir") == str(tmp_path / "vllm")

    g = cmds["guidellm"]
    assert _value(g, "--profile") == f"kind=concurrent,streams={r.streams}"
    assert _value(g, "--constraint") == f"kind=max_requests,count={r.requests}"
    data = f"kind=synthetic_text,prompt_tokens={r.prompt_tokens},output_tokens={r.output_tokens}"
    assert _value(g, "--data") == data
    assert _value(g, "--seed") == f"kind=static,value={r.seed}"
    assert f"model={SERVED}," in _value(g, "--backend")
    assert _value(g, "--output") == f"kind=json,path={tmp_path / 'guidellm' / 'benchmarks.json'}"
    assert by_name["guidellm"].result == "benchmarks.json"

    a = cmds["aiperf"]
    assert _value(a, "--concurrency") == str(r.streams)
    assert _value(a, "--request-count") == str(r.requests)
    assert _value(a, "--synthetic-input-tokens-mean") == str(r.prompt_tokens)
    assert _value(a, "--output-tokens-mean") == str(r.output_tokens)
    assert _value(a, "--synthetic-input-tokens-stddev") == "0"
    assert _value(a, "--output-tokens-stddev") == "0"
    assert _value(a, "--random-seed") == str(r.seed)
    assert _value(a, "--model") == SERVED
    assert _value(a, "--artifact-dir") == str(tmp_path / "aiperf")
    assert _value(a, "--export-level") == "records"
    assert by_name["aiperf"].result == "profile_export.jsonl"


def _layout(out: Path) -> None:
    """One tool with a twin (``vllm``) and one without (``guidellm``, no ITL):

    - training: TTFT p50 0.2 s measured, 0.25 predicted (in-sample); ITL p50 0.02 s both;
    - c8: TTFT p50 0.4 measured, 0.5 predicted (twin 25% off, naive 50%);
    - c4 long: TTFT p50 0.2 measured, 0.3 predicted (twin 50% off, naive 0%);
      ITL p50 0.04 measured, 0.02 predicted (twin 50%, naive 50%).
    GuideLLM measured the same TTFT, no ITL, and has no prediction."""
    train, c8, long = tt.RUNS
    ttft = {train: (0.25, 0.2), c8: (0.5, 0.4), long: (0.3, 0.2)}
    itl = {train: (0.02, 0.02), c8: (0.02, 0.02), long: (0.02, 0.04)}
    for r in tt.RUNS:
        d = out / "vllm" / r.slug
        _write_pred(d / "sim", {"ttft_p50": ttft[r][0], "itl_p50": itl[r][0]})
        _write_run(d / "run", {"ttft_p50": ttft[r][1], "itl_p50": itl[r][1]})
        _write_run(out / "guidellm" / r.slug / "run", {"ttft_p50": ttft[r][1]})


def test_scores_per_tool_and_pooled_leave_out_what_was_not_predicted_or_measured(tmp_path):
    _layout(tmp_path)
    twin = tt.evaluate("vllm", tt.RUNS, tmp_path / "vllm", in_sample=True)
    none = tt.evaluate("guidellm", tt.RUNS, tmp_path / "guidellm", in_sample=False)
    assert [c["case"] for c in twin][0] == "vllm train c4 (in-sample)"
    held = [(tmp_path / t / r.slug / "sim", tmp_path / t / r.slug / "run")
            for t in ("vllm", "guidellm") for r in tt.RUNS if not r.train]  # fmt: skip

    s = tt.scored(twin, held[:2])["figures"]
    assert s["ttft_p50"]["cases"] == 2
    assert s["ttft_p50"]["twin_mape"] == pytest.approx(37.5)  # (25 + 50) / 2
    assert s["ttft_p50"]["naive_mape"] == pytest.approx(25.0)  # (50 + 0) / 2
    # change from training: c8 predicted +100% against +100% measured; long +20% against 0
    assert s["ttft_p50"]["change_error_pp"] == pytest.approx(10.0)
    assert s["ttft_p50"]["target_mape"] is None and s["ttft_p50"]["met"] is None
    assert s["itl_p50"]["twin_mape"] == pytest.approx(25.0)  # (0 + 50) / 2
    assert s["e2e_mean"]["twin_mape"] is None  # neither predicted nor measured

    g = tt.scored(none, held[2:])
    assert g["figures"]["ttft_p50"]["twin_mape"] is None  # no twin: nothing predicted
    assert g["figures"]["ttft_p50"]["naive_mape"] == pytest.approx(25.0)  # still scored
    assert g["figures"]["itl_p50"]["naive_mape"] is None  # GuideLLM has no ITL: missing
    assert g["intervals"] == {}

    pooled = tt.scored([*twin, *none], held)
    # pooled over what the twin predicted: GuideLLM's runs have no prediction to pair
    assert pooled["figures"]["ttft_p50"]["cases"] == 2
    assert pooled["intervals"]["seeds range"]["figures"] == 4  # two figures, two runs

    per_tool = {
        "guidellm": {"twin": {"refused": "no per-token times"}, "score": g},
        "vllm": {"twin": {"path": "twin.json"}, "score": tt.scored(twin, held[:2])},
    }
    text = tt.render_answer(per_tool, pooled)
    assert text.splitlines()[0].startswith("answer: the twin's MAPE is below the naive")
    assert "| ttft_p50 | - / 25.0 | 37.5 / 25.0 | 37.5 / 25.0 |" in text
    assert "guidellm: no twin: no per-token times" in text
    assert max(len(line) for line in text.splitlines()) <= 100
