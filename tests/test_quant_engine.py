"""The engine on quantised and bf16 weights: every scheduling choice leaves the greedy tokens
of such a model unchanged (batching invariance holds for bf16, q8_0 and q4_1 too), and bad
requests for a mode say what is available."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_writer import write_gguf
from model_helpers import PROMPT_TEXTS, TINY_SP, alone, generate, make_engine

from servelab.model import cpu_kernels
from servelab.model.llama import causal_batch
from servelab.model.loader import LoadedModel, load_model
from servelab.model.quant import QuantWeight

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels not built here")


@pytest.fixture(scope="module")
def q4_gguf(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tiny_llama_dir, tmp_path_factory.mktemp("q4") / "tiny-q4_1.gguf", q4_1=True)


BF16 = pytest.param(
    "bf16",
    marks=pytest.mark.skipif(
        not cpu_kernels.bf16_dot_available(), reason="bf16 dots need AVX512-BF16"
    ),
)


@pytest.fixture(scope="module", params=[BF16, "q8_0", "q4_1"])
def quantised(request: pytest.FixtureRequest, tiny_llama_dir: Path, q4_gguf: Path) -> LoadedModel:
    path = q4_gguf if request.param == "q4_1" else tiny_llama_dir
    return load_model(str(path), device="cpu", quantization=request.param)


@pytest.fixture(scope="module")
def prompts(quantised: LoadedModel) -> list[list[int]]:
    shared = quantised.tokenizer.encode("A paged KV cache stores keys and values in blocks. ")
    own = [quantised.tokenizer.encode(t) for t in PROMPT_TEXTS]
    return own + [shared + p for p in own[:3]]


@pytest.fixture(scope="module")
def unbatched(quantised: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    return alone(quantised, prompts, TINY_SP)


def test_weights_stay_quantised(quantised: LoadedModel) -> None:
    layer = quantised.model.layers[0]
    if quantised.quantization == "bf16":  # every product, the LM head's too, in bf16
        for w in (layer.qkv_w, layer.o_w, layer.gate_up_w, layer.down_w, quantised.model.lm_head):
            assert isinstance(w, QuantWeight) and w.kind == "bf16x16"
            assert w.blocks.dtype == torch.bfloat16
        return
    # Interleaved for integer dots where the CPU has them (AVX512-VNNI).
    kind = quantised.quantization + ("x16" if cpu_kernels.int8_dot_available() else "")
    for w in (layer.qkv_w, layer.o_w, layer.gate_up_w, layer.down_w):
        assert isinstance(w, QuantWeight) and w.kind == kind
        assert w.blocks.dtype == torch.uint8
    # q8_0 quantises the LM head too; q4_1 keeps the GGUF's own head (fp32 in this one, as
    # the fp32 kernel takes it: interleaved by 16 rows where the AVX-512 kernels are built).
    head = quantised.model.lm_head
    if quantised.quantization == "q8_0":
        assert isinstance(head, QuantWeight) and head.kind.startswith("q8_0")
    elif cpu_kernels.fp32_interleave_available():
        assert isinstance(head, QuantWeight) and head.kind == "f32x16"
    else:
        assert isinstance(head, torch.Tensor) and head.dtype == torch.float32


@pytest.mark.parametrize(
    "cfg",
    [{}, {"max_num_batched_tokens": 8}, {"num_kv_blocks": 30, "max_num_batched_tokens": 64}],
    ids=["batched", "chunked-8", "tiny-pool"],
)
def test_quantised_batched_equals_alone(
    quantised: LoadedModel, prompts: list[list[int]], unbatched: list[list[int]], cfg: dict
) -> None:
    engine = make_engine(quantised, **cfg)
    assert generate(engine, prompts, TINY_SP) == unbatched
    if cfg.get("max_num_batched_tokens") == 8:
        assert any(len(t.chunks) > 1 for t in engine.finished_timelines)


def test_quantised_prefix_cache_hit_equals_no_cache(
    quantised: LoadedModel, prompts: list[list[int]], unbatched: list[list[int]]
) -> None:
    engine = make_engine(quantised)
    generate(engine, prompts[:1], TINY_SP)
    assert generate(engine, prompts, TINY_SP) == unbatched
    assert engine.stats().prefix_cache_hits > 0


def test_quantised_logits_match_their_reference(
    quantised: LoadedModel, tiny_llama_dir: Path, q4_gguf: Path
) -> None:
    """q4_1 computes the function of its GGUF dequantised to fp32 (mode none): to float
    rounding where its inputs stay fp32, and nearly so where the integer-dot kernel rounds
    them to 8 bits; q8_0 and bf16 nearly fp32's. A wrong block layout or row order would
    not."""
    batch = causal_batch([quantised.tokenizer.encode(PROMPT_TEXTS[0])])
    if quantised.quantization == "q4_1":
        want = load_model(str(q4_gguf), device="cpu").model(batch)
        if not cpu_kernels.int8_dot_available():
            torch.testing.assert_close(quantised.model(batch), want, rtol=1e-3, atol=1e-3)
            return
    else:
        want = load_model(str(tiny_llama_dir), device="cpu").model(batch)
    got = quantised.model(batch)
    assert torch.nn.functional.cosine_similarity(want, got, dim=-1).min() > 0.99
    assert (want.argmax(-1) == got.argmax(-1)).float().mean() > 0.9


def test_modes_without_their_data_say_what_is_available(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="q4_1 runs a GGUF's own Q4_1 blocks.*available: none"):
        load_model(str(tiny_llama_dir), device="cpu", quantization="q4_1")
    fp32_gguf = write_gguf(tiny_llama_dir, tiny_llama_dir.parent / "tiny-fp32.gguf")
    with pytest.raises(ValueError, match="not all Q4_1 .others: F32.*available: none"):
        load_model(str(fp32_gguf), device="cpu", quantization="q4_1")
    with pytest.raises(ValueError, match="use none, bf16, q8_0, q4_1"):
        load_model(str(tiny_llama_dir), device="cpu", quantization="int4")


def test_no_kernels_refuses_quantised_modes(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_kernels, "enabled", False)
    with pytest.raises(ValueError, match="needs servelab's CPU kernels.*AVX2"):
        load_model(str(tiny_llama_dir), device="cpu", quantization="q4_1")
    assert load_model(str(tiny_llama_dir), device="cpu").quantization == "none"


def test_bf16_needs_the_bf16_kernel(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "bf16_dot_available", lambda: False)
    with pytest.raises(ValueError, match="bf16 runs on servelab's AVX512-BF16 kernels"):
        load_model(str(tiny_llama_dir), device="cpu", quantization="bf16")


def test_cli_offers_only_the_modes_that_pass_their_quality_bar() -> None:
    from servelab.server.server_args import ServerArgs

    ServerArgs(quantization="q4_1").validate()
    ServerArgs(quantization="bf16").validate()
    with pytest.raises(ValueError, match="--quantization 'q8_0': use none, bf16, q4_1"):
        ServerArgs(quantization="q8_0").validate()
