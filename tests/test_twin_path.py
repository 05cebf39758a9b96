"""One path for a twin's predictions: `sim --calibration` reads the server's own flags, plans
prompts with the twin's tokenizer (or says it cannot), replays a run directory as its trace,
warns outside the twin's calibrated domain, and carries intervals derived out of sample."""

from __future__ import annotations

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
