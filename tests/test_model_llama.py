"""The decoder against HF transformers on the same weights (tiny random configs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from servelab.model.linear import linear
from servelab.model.llama import causal_batch
from servelab.model.loader import load_model

PROMPTS = ["Hello world! The quick brown fox", "A paged KV cache stores keys and values."]

VARIANTS = {
    "llama_tied": {},
    "llama_untied": {"tie_word_embeddings": False},
    "qwen2_bias": {"model_type": "qwen2", "tie_word_embeddings": False},
    "mha_no_gqa": {"num_key_value_heads": 4},
    "rope_linear": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "rope_dynamic": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    "rope_llama3": {
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "rope_yarn": {
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    },
}


def _hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _hf_greedy(ref, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(ref(torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_greedy_match_transformers(make_tiny_llama, variant: str) -> None:
    path = make_tiny_llama(**VARIANTS[variant])
    ours = load_model(str(path), device="cpu")
    ref = _hf_model(path)
    # Long enough for the scaled rope variants to differ from plain rope.
    ids = ours.tokenizer.encode(" ".join(PROMPTS * 6))
    assert len(ids) > 100
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    got = ours.model(causal_batch([ids]))
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    prompt = ours.tokenizer.encode(PROMPTS[0])
    mine: list[int] = []
    for _ in range(8):
        mine.append(int(ours.model(causal_batch([prompt + mine]))[-1].argmax()))
    assert mine == _hf_greedy(ref, prompt, 8)


def test_batched_sequences_equal_single(tiny_llama_dir: Path) -> None:
    m = load_model(str(tiny_llama_dir), device="cpu")
    seqs = [m.tokenizer.encode(p) for p in PROMPTS]
    together = m.model(causal_batch(seqs))
    alone = torch.cat([m.model(causal_batch([s])) for s in seqs])
    torch.testing.assert_close(together, alone, atol=1e-4, rtol=1e-4)


def test_unsupported_architecture_is_a_clear_error(make_tiny_llama) -> None:
    path = make_tiny_llama(model_type="gpt2")
    with pytest.raises(ValueError, match="Llama-family"):
        load_model(str(path), device="cpu")


@pytest.mark.parametrize("rows", [33, 100, 257])
def test_prefill_products_match_torch(rows: int) -> None:
    """Products over the kernels' rows (prefill: oneDNN on CPU) equal ``x @ w.T`` with a
    bias and with a residual added, for odd shapes."""
    g = torch.Generator().manual_seed(rows)
    x, w, b, res = (torch.randn(s, generator=g) for s in ((rows, 67), (45, 67), (45,), (rows, 45)))
    want = x @ w.T
    torch.testing.assert_close(linear(x, w), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear(x, w, b), want + b, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear(x, w, residual=res.clone()), res + want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(
        linear(x[:, :60], w[:, :60].contiguous()), x[:, :60] @ w[:, :60].T, rtol=1e-5, atol=1e-4
    )
