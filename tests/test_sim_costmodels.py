"""Cost models of the simulator: hand-computed roofline cases, presets, profile interpolation."""

from __future__ import annotations

import json
import random

import pytest

from servelab.sim.costs.dtypes import Precision
from servelab.sim.costs.hardware import HARDWARE, get_hardware
from servelab.sim.costs.model_shapes import PRESETS, load_model_spec
from servelab.sim.costs.profiled import ProfiledCostModel, ProfileSample, ProfileTable, tail_slope
from servelab.sim.costs.roofline import Efficiency, RooflineCostModel
from servelab.sim.costs.work import StepWork, decode_work

GGUF = "smollm2-135m"


def test_llama_8b_parameter_count_and_kv_bytes():
    m = PRESETS["llama-3.1-8b"]
    assert m.num_params == pytest.approx(8.03e9, rel=0.002)
    assert m.kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2 == 131072


@pytest.mark.parametrize(
    "name,params",
    [
        ("llama-3.1-70b", 70.55e9),
        ("qwen2.5-7b", 7.62e9),
        ("qwen2.5-32b", 32.76e9),
        ("smollm2-135m", 134.5e6),
    ],
)
def test_preset_parameter_counts_match_published_sizes(name, params):
    assert PRESETS[name].num_params == pytest.approx(params, rel=0.005)


def test_hf_config_json_and_gguf_give_the_same_shapes(tmp_path):
    cfg = {
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
        "model_type": "llama",
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from_json = load_model_spec(str(tmp_path))
    assert from_json.num_params == PRESETS["smollm2-135m"].num_params
    from servelab.modelcore.catalogue import resolve_model

    from_gguf = load_model_spec(str(resolve_model(GGUF)))
    assert from_gguf.num_params == PRESETS["smollm2-135m"].num_params
    assert (
        from_gguf.kv_bytes_per_token(4) == 46080
    )  # docs/reference-figures.md: about 46 KB per token in fp32


def test_unknown_names_say_what_exists():
    with pytest.raises(ValueError, match="llama-3.1-8b"):
        load_model_spec("gpt-17")
    with pytest.raises(ValueError, match="h200"):
        get_hardware("tpu-v9")
    assert get_hardware("H100_SXM") is HARDWARE["h100"]


def test_every_hardware_entry_cites_a_source():
    for hw in HARDWARE.values():
        assert len(hw.source) > 20 and hw.peak_flops > 0 and hw.mem_bw > 0


def _decode(batch: int, ctx: int) -> StepWork:
    w = StepWork()
    for _ in range(batch):
        w.add(1, ctx, 1)
    return w


def test_roofline_decode_is_memory_bound_hand_computed():
    m, hw = PRESETS["llama-3.1-8b"], HARDWARE["h100"]
    eff = Efficiency(mfu=0.5, mbu=0.75, step_overhead=1e-3, layer_overhead=5e-6)
    rm = RooflineCostModel(m, hw, efficiency=eff)
    c = rm.cost(_decode(1, 1023))
    # Streamed: every parameter but the input embedding (128256 x 4096), which is indexed.
    weights = (8_030_261_248 - 128256 * 4096) * 2
    kv = 131072 * (1024 + 1)  # read 1024 positions, write 1
    assert c.bytes == pytest.approx(weights + kv)
    assert c.bound == "memory"
    expected = (weights + kv) / (3.35e12 * 0.75) + 1e-3 + 32 * 5e-6
    assert rm.predict(_decode(1, 1023)) == pytest.approx(expected)
    # About 6.6 ms + 1.2 ms: a batch-1 Llama-8B token on an H100 at 75% of HBM bandwidth.
    assert 7e-3 < expected < 9e-3


def test_roofline_prefill_is_compute_bound_hand_computed():
    m, hw = PRESETS["llama-3.1-8b"], HARDWARE["h200"]
    rm = RooflineCostModel(m, hw, efficiency=Efficiency(mfu=0.5, step_overhead=0, layer_overhead=0))
    w = StepWork()
    w.add(2048, 0, 1)
    lin = 2 * 32 * (4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096) * 2048
    attn = 4 * 32 * 32 * 128 * (2048 * 2049 / 2)
    head = 2 * 4096 * 128256
    c = rm.cost(w)
    assert c.flops == pytest.approx(lin + attn + head)
    assert c.bound == "compute"
    assert rm.predict(w) == pytest.approx((lin + attn + head) / (989e12 * 0.5))


def test_gemms_and_attention_each_sit_on_their_own_roofline():
    # A large decode batch: the GEMMs are compute-bound (1024 tokens through FP8 weights)
    # while attention streams 1024 x 2048 tokens of KV. The kernels run one after the
    # other, so the step costs the GEMMs' compute plus the attention's memory time, more
    # than the larger of total compute and total memory.
    m, hw = PRESETS["llama-3.1-8b"], HARDWARE["h200"]
    eff = Efficiency(mfu=0.5, mbu=0.75, step_overhead=0.0, layer_overhead=0.0)
    rm = RooflineCostModel(m, hw, efficiency=eff, precision=Precision.parse("fp8", None, "bf16"))
    c = rm.cost(_decode(1024, 2047))
    assert c.gemm_compute > c.gemm_memory and c.attn_memory > c.attn_compute
    # Each of the 1024 reads its 2048 positions; the step writes 1024 new ones.
    assert c.attn_memory == pytest.approx(131072 * (1024 * 2048 + 1024) / (4.8e12 * 0.75))
    assert rm.predict(_decode(1024, 2047)) == pytest.approx(c.gemm_compute + c.attn_memory)
    assert c.time > max(c.compute_time, c.memory_time)


def test_tensor_parallel_splits_work_and_adds_communication():
    m, hw = PRESETS["llama-3.1-70b"], HARDWARE["h100"]
    w = _decode(32, 2000)
    one = RooflineCostModel(m, hw, tp=1).cost(w)
    four = RooflineCostModel(m, hw, tp=4).cost(w)
    assert four.memory_time == pytest.approx(one.memory_time / 4)
    assert one.comm_time == 0 and four.comm_time > 0
    # 2 all-reduces per layer of 32 tokens * 8192 * 2 B, ring over 4 devices.
    ar = 2 * 3 / 4 * (32 * 8192 * 2) / hw.link_bw + hw.link_latency
    assert four.comm_time == pytest.approx(2 * 80 * ar)


def test_kv_capacity_is_memory_minus_weights_over_kv_bytes():
    rm = RooflineCostModel(PRESETS["llama-3.1-8b"], HARDWARE["h100"])
    expected = (80e9 * 0.9 - 8_030_261_248 * 2 - 1e9) // 131072
    assert rm.kv_capacity_tokens() == expected
    with pytest.raises(ValueError, match="tp"):
        RooflineCostModel(PRESETS["llama-3.1-70b"], HARDWARE["h100"]).kv_capacity_tokens()
    assert (
        RooflineCostModel(PRESETS["llama-3.1-70b"], HARDWARE["h100"], tp=4).kv_capacity_tokens() > 0
    )


def test_roofline_sanity_against_a_published_measurement():
    # johnmusgrave.com "vLLM throughput-latency sweep on NVIDIA A100": Llama-3.1-8B-Instruct
    # bf16 on an A100 40GB, vLLM 0.23, 1024 in / 128 out, one request: ~75 tok/s (13.3 ms).
    rm = RooflineCostModel(PRESETS["llama-3.1-8b"], HARDWARE["a100-40gb"])
    t = rm.predict(_decode(1, 1024 + 64))
    assert t == pytest.approx(1 / 75, rel=0.15)


def _synthetic_truth(w: StepWork) -> float:
    # A weight-bound base with a bump at small batches (MKL's 4-16 row pathology) + attention.
    base = 0.060 + 0.0009 * w.tokens + max(0.0, 0.02 * (1 - abs(w.tokens - 8) / 8))
    return base + 2e-9 * w.attn_pairs + 4e-7 * w.kv_read + 1e-4 * w.seqs


def _grid() -> list[StepWork]:
    shapes = []
    for d in (1, 2, 4, 8, 16, 32, 64):
        for ctx in (64, 512, 2048):
            shapes.append(_decode(d, ctx))
    for p in (16, 64, 256, 1024):
        for pre in (0, 1024):
            w = StepWork()
            w.add(p, pre, 1)
            shapes.append(w)
    return shapes


def test_profiled_model_interpolates_a_known_surface():
    table = ProfileTable("toy", "cpu", [ProfileSample(w, _synthetic_truth(w)) for w in _grid()])
    pm = ProfiledCostModel(table)
    assert pm.fit_error < 0.01
    rng = random.Random(0)
    errs = []
    for _ in range(200):  # held-out mixed steps at shapes never profiled
        w = StepWork()
        for _ in range(rng.randint(1, 40)):
            w.add(1, rng.randint(10, 2000), 1)
        if rng.random() < 0.5:
            w.add(rng.randint(20, 900), rng.choice([0, 300]), 1)
        errs.append(abs(pm.predict(w) - _synthetic_truth(w)) / _synthetic_truth(w))
    errs.sort()
    assert errs[len(errs) // 2] < 0.05 and errs[int(len(errs) * 0.95)] < 0.15


def test_profile_table_round_trips_and_rejects_foreign_files(tmp_path):
    table = ProfileTable(
        "toy", "cpu", [ProfileSample(w, _synthetic_truth(w)) for w in _grid()], meta={"threads": 1}
    )
    path = table.save(tmp_path / "p.json")
    again = ProfileTable.load(path)
    assert ProfiledCostModel(again).predict(_decode(3, 100)) == pytest.approx(
        ProfiledCostModel(table).predict(_decode(3, 100))
    )
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="servelab profile"):
        ProfileTable.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="servelab profile"):
        ProfileTable.load(tmp_path / "missing.json")


def test_work_of_plan_matches_step_work_add():
    from servelab.engine.batch_plan import BatchPlan, ScheduledSeq
    from servelab.engine.sampling_params import SamplingParams
    from servelab.sim.costs.work import work_of_plan

    rng = random.Random(5)
    sp = SamplingParams()
    for _ in range(50):
        seqs, expected = [], StepWork()
        for i in range(rng.randint(1, 12)):
            n = rng.choice([1, 1, 1, rng.randint(2, 300)])
            start = rng.randint(0, 4000)
            sample = n == 1 or rng.random() < 0.5
            drafts = [3] * rng.randint(0, 3) if n == 1 else []
            seqs.append(
                ScheduledSeq(f"s{i}", [7] * n, start, [], sample, sp, draft_token_ids=drafts)
            )
            expected.add(n + len(drafts), start, (1 + len(drafts)) if sample else 0)
        assert work_of_plan(BatchPlan(0, seqs)) == expected


def test_cpu_roofline_sits_between_the_anchored_floor_and_a_stock_forward():
    # docs/reference-figures.md: SmolLM2 fp32 decode floor ~32 ms (538 MB at ~17 GB/s); a plain torch
    # forward with stock kernels took 72 ms; prefill ~212 MFLOP per token.
    rm = RooflineCostModel(PRESETS["smollm2-135m"], HARDWARE["cpu"])
    assert rm.model.weight_bytes(4) == pytest.approx(538e6, rel=0.01)
    assert 0.032 < rm.predict(_decode(1, 128)) < 0.072
    w = StepWork()
    w.add(512, 0, 1)
    per_token = (rm.cost(w).flops - 2 * 576 * 49152) / 512
    assert per_token == pytest.approx(212e6, rel=0.15)


def test_profiled_model_is_unbiased_under_noise_and_extrapolates_upwards():
    rng = random.Random(1)
    samples = []
    for w in _grid():
        for _ in range(8):  # noisy repeats, as the steps of a real run on a busy machine
            samples.append(ProfileSample(w, _synthetic_truth(w) * rng.lognormvariate(0, 0.3)))
    pm = ProfiledCostModel(ProfileTable("toy", "cpu", samples))
    ratios = [pm.predict(w) / _synthetic_truth(w) for w in _grid()]
    # It tracks the mean step time, exp(0.3**2 / 2) = 1.046 times the noiseless one; weighting
    # by the noisy values themselves would sit 10-20% low.
    assert sum(ratios) / len(ratios) == pytest.approx(1.046, abs=0.04)
    big = StepWork()
    big.add(1024, 0, 1)
    bigger = StepWork()
    bigger.add(4096, 0, 1)
    assert pm.predict(bigger) > pm.predict(big) > 0


def test_past_the_last_knot_a_token_costs_the_upper_half_slope_not_the_last_segments():
    # One run's prefills: 2 ms a token up to 811 tokens, then 118 ms more over three tokens
    # (noise). The last segment alone would price a token beyond at 39 ms.
    knots = [1.0, 370.0, 658.0, 811.0, 814.0]
    g = [0.04, 0.7, 1.28, 1.54, 1.656]
    slope = tail_slope(knots, g)
    assert slope == pytest.approx((1.656 - 0.7) / (814 - 370))  # from the last knot <= 407
    assert 0.0019 < slope < 0.0025
    # flat or falling ends keep at least the average slope over every knot
    assert tail_slope([1.0, 500.0, 1000.0], [0.1, 1.0, 0.9]) == pytest.approx(0.8 / 999)
    assert tail_slope([10.0], [0.5]) == pytest.approx(0.05)


@pytest.mark.parametrize(
    ("hw", "model", "tp", "dtype"),
    [("h200", "llama-3.1-8b", 1, None), ("h100", "llama-3.1-70b", 4, "fp8"), ("l4", GGUF, 2, None)],
)
def test_roofline_prices_a_decode_step_as_its_work_and_explains_it_the_same(hw, model, tp, dtype):
    """``decode_time`` (every step of a decode burst) and ``predict`` are ``cost().time``
    to the last bit, on decode and mixed steps alike."""
    rm = RooflineCostModel(
        load_model_spec(model),
        get_hardware(hw),
        tp=tp,
        precision=Precision.parse(dtype, None, "bf16"),
    )
    rng = random.Random(0)
    for _ in range(300):
        n, ctx = rng.randint(1, 1024), rng.randint(0, 2_000_000)
        assert (
            rm.decode_time(n, ctx)
            == rm.predict(decode_work(n, ctx))
            == rm.cost(decode_work(n, ctx)).time
        )
        w = StepWork()
        for _ in range(rng.randint(1, 30)):
            w.add(rng.choice([1, rng.randint(2, 3000)]), rng.randint(0, 30_000), 1)
        assert rm.predict(w) == rm.cost(w).time


def test_profiled_model_prices_a_decode_step_as_its_work():
    table = ProfileTable("toy", "cpu", [ProfileSample(w, _synthetic_truth(w)) for w in _grid()])
    pm = ProfiledCostModel(table)
    for n, ctx in [(1, 0), (3, 700), (64, 90_000), (200, 10**6)]:
        assert pm.decode_time(n, ctx) == pm.predict(decode_work(n, ctx))
