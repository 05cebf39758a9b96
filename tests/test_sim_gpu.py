"""GPU what-ifs: the simulated engines' cited defaults, and the datatype rules by hand."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from servelab.cli import app
from servelab.engine.engine_config import EngineConfig
from servelab.sim.costs.dtypes import Precision
from servelab.sim.costs.hardware import HARDWARE
from servelab.sim.costs.model_shapes import ModelSpec
from servelab.sim.costs.roofline import Efficiency, RooflineCostModel
from servelab.sim.costs.work import StepWork
from servelab.sim.engine_defaults import engine_defaults, sglang_max_running
from servelab.sim.sim_target import roofline_target

# (hardware, vLLM serve max_num_seqs, max_num_batched_tokens, offline tokens), from vLLM's
# EngineArgs.get_batch_defaults: >= 70 GiB and not an A100 -> 1024 / 8192 (16384 offline).
VLLM_TABLE = [
    ("h100", 1024, 8192, 16384),
    ("h200", 1024, 8192, 16384),
    ("b200", 1024, 8192, 16384),
    ("mi300x", 1024, 8192, 16384),
    ("a100", 256, 2048, 8192),
    ("a100-40gb", 256, 2048, 8192),
    ("l4", 256, 2048, 8192),
]
# (hardware, tp, SGLang chunked_prefill_size, mem_fraction_static) from ServerArgs: memory
# in MiB (80e9 B = 76,294 MiB: reserved (9.5 + 1/2) GiB -> (76294 - 10240) / 76294 = 0.866).
SGLANG_TABLE = [
    ("h100", 1, 8192, 0.866),
    ("h100", 8, 8192, 0.819),  # reserved (9.5 + 4) GiB
    ("h200", 1, 8192, 0.905),  # 134,468 MiB, reserved 12.5 GiB
    ("b200", 1, 16384, 0.809),  # 171,661 MiB, reserved 32 GiB
    ("mi300x", 1, 16384, 0.821),  # 183,105 MiB, reserved 32 GiB
    ("l4", 1, 2048, 0.870),  # 22,888 MiB, reserved 2.9 GiB
]


@pytest.mark.parametrize("hw,seqs,tokens,offline_tokens", VLLM_TABLE)
def test_vllm_defaults_follow_its_memory_classes(hw, seqs, tokens, offline_tokens):
    d = engine_defaults("vllm", HARDWARE[hw])
    assert d.config["max_num_seqs"] == seqs
    assert d.config["max_num_batched_tokens"] == tokens
    assert d.config["block_size"] == 16 and d.config["enable_chunked_prefill"]
    assert d.gpu_memory_utilization == 0.9 and "arg_utils.py" in d.source
    assert engine_defaults("vllm", HARDWARE[hw], offline=True).config["max_num_batched_tokens"] == (
        offline_tokens
    )


@pytest.mark.parametrize("hw,tp,chunk,fraction", SGLANG_TABLE)
def test_sglang_defaults_follow_its_memory_classes(hw, tp, chunk, fraction):
    d = engine_defaults("sglang", HARDWARE[hw], tp=tp)
    assert d.config["max_num_batched_tokens"] == chunk
    assert d.gpu_memory_utilization == fraction
    assert d.config["block_size"] == 1 and "server_args.py" in d.source


def test_sglang_running_cap_is_half_the_pool_within_its_request_slots():
    assert sglang_max_running(400_000, 131072) == 2048  # 1,562 slots by context: floor 2048
    assert sglang_max_running(3_000_000, 32768) == 4096  # ceiling
    assert sglang_max_running(3000, 8192) == 1500  # half the KV tokens


def test_servelab_defaults_are_the_engine_config_and_cpu_rejects_gpu_engines():
    d = engine_defaults("servelab", HARDWARE["cpu"])
    c = EngineConfig()
    assert d.config["max_num_seqs"] == c.max_num_seqs
    assert d.config["max_num_batched_tokens"] == c.max_num_batched_tokens
    with pytest.raises(ValueError, match="not a GPU"):
        engine_defaults("vllm", HARDWARE["cpu"])
    with pytest.raises(ValueError, match="vllm, sglang, servelab"):
        engine_defaults("tgi", HARDWARE["h100"])


def test_engine_args_override_the_defaults_and_the_target_records_both():
    t = roofline_target("h200", "llama-3.1-8b", engine="vllm", engine_args={"max_num_seqs": 128})
    assert t.engine_config.max_num_seqs == 128
    assert t.engine_config.max_num_batched_tokens == 8192
    used = t.describe()["engine_defaults"]
    assert used["engine"] == "vllm" and used["overridden"] == ["max_num_seqs"]
    s = roofline_target("h200", "llama-3.1-8b", engine="sglang")
    kv_tokens = s.cost_model.kv_capacity_tokens(0.905)  # ~843k tokens of 128 KiB
    assert s.engine_config.max_num_seqs == int(kv_tokens / 131072 * 512) == 3294
    assert s.engine_config.block_size == 1
    assert s.describe()["gpu_memory_utilization"] == 0.905


def _one_layer() -> ModelSpec:
    return ModelSpec("one", 4096, 1, 32, 8, 128, 14336, 1000, False, 8192)


def _step() -> StepWork:
    w = StepWork()
    w.add(512, 0, 1)  # a 512-token prefill: 512 * 513 / 2 causal pairs, one logit
    return w


def test_dtype_flops_and_bytes_by_hand_on_one_layer():
    m, hw = _one_layer(), HARDWARE["h100"]
    eff = Efficiency(mfu=0.5, mbu=0.75, step_overhead=0.0, layer_overhead=0.0)
    # q and o 4096x4096, k and v 4096x1024, gate/up/down 4096x14336, two norms.
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert layer == 218_112_000
    rest = 4096 * 1000 + 4096  # LM head and final norm, 16-bit; the embedding is only indexed
    lin_flops = 2 * layer * 512
    other_flops = 4 * 32 * 128 * (512 * 513 / 2) + 2 * 4096 * 1000
    kv_bf16 = 2 * 8 * 128 * 2  # K and V of one layer, 2 bytes each
    cases = {
        # dtype: (layer bytes per weight, decoder GEMM peak)
        "bf16": (2.0, 989e12),
        "fp8": (1.0, 1979e12),  # W8A8 runs at the FP8 peak, 2x BF16
        "int8": (1.0, 989e12),  # weight-only: fewer bytes, 16-bit math
        "int4": (0.5 + 2 / 128, 989e12),  # plus one fp16 scale per 128 weights
    }
    for dtype, (wb, peak) in cases.items():
        rm = RooflineCostModel(
            m, hw, efficiency=eff, precision=Precision.parse(dtype, None, "bf16")
        )
        c = rm.cost(_step())
        weights = layer * wb + rest * 2
        # KV: the chunk reads its own 512 positions back and writes 512.
        assert c.bytes == pytest.approx(weights + kv_bf16 * (512 + 512)), dtype
        assert c.flops == pytest.approx(lin_flops + other_flops), dtype
        assert c.compute_time == pytest.approx((lin_flops / peak + other_flops / 989e12) / 0.5), (
            dtype
        )
    fp8_kv = RooflineCostModel(m, hw, precision=Precision.parse("bf16", "fp8", "bf16"))
    assert fp8_kv.kv_bytes_per_token_per_device == kv_bf16 / 2


def test_fp8_without_fp8_tensor_cores_is_weight_only():
    rm = RooflineCostModel(
        _one_layer(), HARDWARE["a100"], precision=Precision.parse("fp8", None, "bf16")
    )
    assert rm.gemm_dtype == "bf16"
    for hw in ("h100", "h200", "b200", "mi300x"):  # the datasheets' dense FP8 is 2x BF16
        assert HARDWARE[hw].peaks["fp8"] == pytest.approx(2 * HARDWARE[hw].peak_flops, rel=1e-3)


def test_a_model_too_big_for_the_gpu_says_so_with_numbers_and_int4_fits():
    with pytest.raises(ValueError, match=r"llama-3.1-70b in bf16 \(141\.\d GB .* tp=1\)"):
        roofline_target("h100", "llama-3.1-70b", engine="vllm")
    t = roofline_target("h100", "llama-3.1-70b", engine="vllm", dtype="int4")
    assert t.engine_config.kv_cache_memory_gb > 20
    with pytest.raises(ValueError, match="bf16, fp16, fp8, int8, int4"):
        roofline_target("h100", "llama-3.1-8b", dtype="nf4")
    with pytest.raises(ValueError, match="fp32 only"):
        roofline_target("cpu", "smollm2-135m", dtype="int4")


def test_cli_defaults_to_vllm_on_gpus_and_names_what_it_used(tmp_path):
    runner = CliRunner()
    out = tmp_path / "run"
    base = ["sim", "--model", "llama-3.1-8b", "--workload", "chat", "--rate", "4"]
    r = runner.invoke(
        app, [*base, "--hardware", "h100", "--requests", "6", "--dtype", "fp8", "--out", str(out)]
    )
    assert r.exit_code == 0, r.output
    assert "engine defaults: vllm on h100" in r.output and "max_num_seqs=1024" in r.output
    target = json.loads((out / "manifest.json").read_text())["server"]["simulated"]
    assert target["engine_config"]["max_num_batched_tokens"] == 8192
    assert target["cost_model"]["gemm_dtype"] == "fp8"
    r = runner.invoke(app, [*base, "--hardware", "h100", "--engine", "trt"])
    assert r.exit_code == 2 and "vllm, sglang, servelab" in r.output
    r = runner.invoke(app, [*base, "--hardware", "h100", "--dtype", "fp4"])
    assert r.exit_code == 2 and "int4" in r.output and "Traceback" not in r.output
