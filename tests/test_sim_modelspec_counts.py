"""ModelSpec's FLOP and byte counts: hand-computed for SmolLM2-135M, the same as the
roofline prices, and the bytes a decode step of each servelab weight mode reads."""

from __future__ import annotations

import pytest

from servelab.sim.costs.hardware import get_hardware
from servelab.sim.costs.model_shapes import PRESETS
from servelab.sim.costs.roofline import RooflineCostModel
from servelab.sim.costs.work import StepWork, decode_work

SMOL = PRESETS["smollm2-135m"]  # hidden 576, 30 layers, 9 heads, 3 KV heads of 64, MLP 1536
MATRICES = 576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536  # one layer: q/k/v, o, MLP
NORMS = 30 * 2 * 576 + 576
HEAD = 49152 * 576


def test_smollm2_flops_by_hand():
    assert SMOL.layer_matrix_params == MATRICES
    assert SMOL.flops_per_token == 2 * (30 * MATRICES + 30 * 2 * 576)
    assert SMOL.flops_per_logit == 2 * HEAD
    assert SMOL.flops_per_attn_pair == 4 * 30 * 9 * 64
    prefill = StepWork()
    prefill.add(512, 0, logits=1)
    expect = 512 * SMOL.flops_per_token + 2 * HEAD + 4 * 30 * 9 * 64 * 512 * 513 / 2
    assert SMOL.flops(prefill) == expect


@pytest.mark.parametrize("name", ["smollm2-135m", "llama-3.1-8b", "qwen2.5-7b"])
def test_the_roofline_prices_the_flops_modelspec_counts(name):
    spec = PRESETS[name]
    roof = RooflineCostModel(spec, get_hardware("h100" if name != "smollm2-135m" else "cpu"))
    prefill = StepWork()
    prefill.add(300, 100, logits=1)
    for work in (prefill, decode_work(8, 8 * 700)):
        assert roof.cost(work).flops == pytest.approx(spec.flops(work), rel=1e-12)


@pytest.mark.parametrize(
    ("matrix", "head", "expect"),
    [
        (4.0, 4.0, 538_060_032),  # none: fp32 throughout
        (34 / 32, 34 / 32, 143_025_408),  # q8_0: blocks of 32 weights in 34 bytes
        (20 / 32, 34 / 32, 96_576_768),  # q4_1 (20 bytes a block), the GGUF's q8_0 head
    ],
)
def test_streamed_bytes_are_what_a_decode_step_of_each_weight_mode_reads(matrix, head, expect):
    # The figures are the loaded model's tensor bytes in each servelab weight mode.
    assert SMOL.streamed_bytes(matrix, head, 4.0) == expect
    assert 30 * MATRICES * matrix + HEAD * head + NORMS * 4.0 == expect
    assert SMOL.streamed_bytes(4.0, 4.0, 4.0) == 4 * SMOL.streamed_params
