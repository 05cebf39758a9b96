"""The simulated vLLM's server and model coverage: the serving path in the loop, the fitted
GPU presets, MoE and any-``model_type`` shapes, L40S, the per sequence-layer step cost."""

from __future__ import annotations

import dataclasses
import json

import pytest

from servelab.engine.engine_config import EngineConfig
from servelab.sim.costs.hardware import HARDWARE, get_hardware
from servelab.sim.costs.model_shapes import PRESETS, load_model_spec, spec_from_hf_config
from servelab.sim.costs.roofline import Efficiency, RooflineCostModel
from servelab.sim.costs.serving_path import ServingPath
from servelab.sim.engine_defaults import VLLM_EFFICIENCY, VLLM_SERVING_PATH, engine_defaults
from servelab.sim.loop.simulation import SimRequest
from servelab.sim.scenario import Scenario, simulate
from servelab.sim.sim_target import roofline_target

MIXTRAL = {
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}
QWEN3_14B = {
    "model_type": "qwen3",
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 40,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
}


def _requests(n: int, gap: float = 0.05, prompt: int = 64, out: int = 16) -> list[SimRequest]:
    return [
        SimRequest(f"r{i}", i * gap, [100 + i * 1000 + j for j in range(prompt)], out)
        for i in range(n)
    ]


def _run(path: ServingPath | None, reqs: list[SimRequest]) -> list:
    target = roofline_target(
        "h100", "llama-3.1-8b", engine_config=EngineConfig(max_num_seqs=8, block_size=16)
    )
    target = dataclasses.replace(target, serving_path=path)
    res = simulate(Scenario(target=target, requests=reqs), keep_steps=True)
    return sorted(res.records, key=lambda r: r.request_id)


def test_no_serving_path_leaves_chunks_at_step_ends():
    recs = _run(None, _requests(3, gap=1.0))
    with_zero = _run(ServingPath(), _requests(3, gap=1.0))
    assert [r.chunk_times for r in recs] == [r.chunk_times for r in with_zero]


def test_inbound_time_delays_the_first_token_by_exactly_that_on_an_idle_engine():
    # Requests 1 s apart on an idle engine: the first token waits for nothing else.
    base = _run(None, _requests(3, gap=1.0))
    delayed = _run(ServingPath(per_request=0.004, per_prompt_token=1e-5), _requests(3, gap=1.0))
    for a, b in zip(base, delayed):
        assert b.ttft - a.ttft == pytest.approx(0.004 + 64 * 1e-5, abs=1e-9)
        assert b.e2e - a.e2e == pytest.approx(0.004 + 64 * 1e-5, abs=1e-9)


def test_output_lag_is_steps_of_the_step_before_and_keeps_the_stream_ordered():
    reqs = _requests(6, gap=0.002)  # overlapping: prefills mixed with decodes, bursts
    base = _run(None, reqs)
    lagged = _run(ServingPath(output_steps=1.5), reqs)
    for a, b in zip(base, lagged):
        assert len(a.chunk_times) == len(b.chunk_times) == 16
        assert all(y >= x for x, y in zip(b.chunk_times, b.chunk_times[1:]))
        assert all(y > x for x, y in zip(a.chunk_times, b.chunk_times))
        assert b.done == b.chunk_times[-1]
    # Alone on the engine, chunk 5 lags by 1.5 of the step before its own (chunks 3 to 4).
    solo_a = _run(None, _requests(1))[0]
    solo_b = _run(ServingPath(output_steps=1.5), _requests(1))[0]
    step = solo_a.chunk_times[4] - solo_a.chunk_times[3]
    assert solo_b.chunk_times[5] - solo_a.chunk_times[5] == pytest.approx(1.5 * step, rel=1e-6)


def test_serving_path_rejects_negative_delays():
    with pytest.raises(ValueError):
        ServingPath(output_steps=-1)


def test_vllm_gpu_presets_carry_the_fitted_costs_and_server_the_others_do_not():
    d = engine_defaults("vllm", HARDWARE["h100"])
    assert d.efficiency == VLLM_EFFICIENCY and d.serving_path == VLLM_SERVING_PATH
    assert VLLM_SERVING_PATH.output_steps > 0 and "sim-to-real" in VLLM_SERVING_PATH.source
    assert engine_defaults("vllm", HARDWARE["h100"], offline=True).serving_path is None
    assert engine_defaults("sglang", HARDWARE["h100"]).serving_path is None
    t = roofline_target("h100", "llama-3.1-8b", engine="vllm")
    assert t.serving_path == VLLM_SERVING_PATH
    assert t.cost_model.describe()["efficiency"]["mbu"] == VLLM_EFFICIENCY.mbu
    # An explicit engine config (the CPU and what-if paths) keeps the plain defaults.
    plain = roofline_target("h100", "llama-3.1-8b", engine_config=EngineConfig())
    assert plain.serving_path is None
    assert plain.cost_model.describe()["efficiency"] == Efficiency().to_dict()


def test_seq_layer_overhead_adds_seqs_times_layers():
    spec, hw = PRESETS["llama-3.1-8b"], HARDWARE["h100"]
    base = RooflineCostModel(spec, hw)
    more = RooflineCostModel(spec, hw, efficiency=Efficiency(seq_layer_overhead=1e-6))
    assert more.decode_time(10, 5000) - base.decode_time(10, 5000) == pytest.approx(
        10 * 32 * 1e-6, rel=1e-9
    )


def test_moe_shapes_by_hand_count_every_expert_but_run_the_routed_ones():
    m = spec_from_hf_config(MIXTRAL, "mixtral-8x7b")
    h, i = 4096, 14336
    attn = h * 4096 + 2 * h * 1024 + 4096 * h
    assert m.layer_matrix_params == attn + 8 * 3 * h * i + 8 * h
    assert m.active_layer_params == attn + 2 * 3 * h * i + 8 * h + 2 * h
    # Mixtral-8x7B: 46.7 B parameters, 12.9 B of them active per token (Mistral AI).
    assert m.num_params / 1e9 == pytest.approx(46.7, rel=0.01)
    active = m.layers * m.active_layer_params + 2 * m.vocab * h
    assert active / 1e9 == pytest.approx(12.9, rel=0.01)
    assert m.flops_per_token == 2 * m.layers * m.active_layer_params


def test_any_model_type_with_standard_shapes_is_read(tmp_path):
    p = tmp_path / "Qwen3-14B" / "config.json"
    p.parent.mkdir()
    p.write_text(json.dumps(QWEN3_14B))
    m = load_model_spec(str(p))
    assert (m.name, m.heads, m.kv_heads, m.head_dim, m.experts) == ("Qwen3-14B", 40, 8, 128, 0)
    assert m.num_params / 1e9 == pytest.approx(14.8, rel=0.01)  # the model card's 14.8 B
    nested = spec_from_hf_config({"model_type": "x", "text_config": QWEN3_14B}, "n")
    assert nested.hidden == 5120
    with pytest.raises(ValueError, match="intermediate_size"):
        spec_from_hf_config({k: v for k, v in QWEN3_14B.items() if k != "intermediate_size"}, "q")


def test_l40s_is_in_the_catalogue_and_a_14b_model_fits_it():
    hw = get_hardware("l40s")
    assert (hw.memory_bytes, hw.mem_bw, hw.peak_flops) == (48e9, 864e9, 362.05e12)
    t = roofline_target("l40s", spec_from_hf_config(QWEN3_14B, "qwen3-14b"), engine="vllm")
    assert 5 < t.engine_config.kv_cache_memory_gb < 15
