"""The GGUF route on a file written here the way llama.cpp's converter writes one.

The tiny random Llama (and a Qwen2 variant) is converted to GGUF with llama.cpp's Q/K row
permutation and its tokenizer metadata; loading that GGUF must give the same logits and
the same tokenizer as loading the HF directory it came from.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_writer import llama_cpp_permute, write_gguf

from servelab.model.gguf_load import unpermute_rotary
from servelab.model.llama import causal_batch
from servelab.model.loader import load_model
from servelab.modelcore.tokenizer import Tokenizer

TEXTS = ["Hello world! The quick brown fox", "ünïcødé 日本語 😀 and <|im_end|>", "x  =  12345\n\n"]


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert np.array_equal(unpermute_rotary(llama_cpp_permute(w, 8), 8), w)


@pytest.mark.parametrize("overrides", [{}, {"model_type": "qwen2", "tie_word_embeddings": False}])
def test_gguf_loads_like_its_hf_source(
    make_tiny_llama, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: dict
) -> None:
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path / "cache"))
    hf_dir = make_tiny_llama(**overrides)
    gguf_path = write_gguf(hf_dir, tmp_path / "tiny.gguf")
    from_hf = load_model(str(hf_dir), device="cpu")
    from_gguf = load_model(str(gguf_path), device="cpu")
    assert from_gguf.config.tie_word_embeddings == from_hf.config.tie_word_embeddings
    assert from_gguf.config.qkv_bias == from_hf.config.qkv_bias
    ids = from_hf.tokenizer.encode(" ".join(TEXTS))
    torch.testing.assert_close(
        from_gguf.model(causal_batch([ids])),
        from_hf.model(causal_batch([ids])),
        atol=1e-5,
        rtol=1e-5,
    )
    # The dequantised weights were cached, and a second load reads the cache.
    entries = list((tmp_path / "cache" / "weights").iterdir())
    assert len(entries) == 1 and (entries[0] / "model.safetensors").is_file()
    load_model(str(gguf_path), device="cpu")
    assert list((tmp_path / "cache" / "weights").iterdir()) == entries


def test_gguf_tokenizer_equals_its_tokenizer_json(tiny_llama_dir: Path, tmp_path: Path) -> None:
    gguf_path = write_gguf(tiny_llama_dir, tmp_path / "tiny.gguf")
    a, b = Tokenizer.from_model(str(gguf_path)), Tokenizer.from_model(str(tiny_llama_dir))
    for text in TEXTS:
        assert a.encode(text) == b.encode(text), text
        assert a.decode(a.encode(text)) == b.decode(b.encode(text))
    msgs = [{"role": "user", "content": "hi"}]
    assert a.apply_chat_template(msgs) == b.apply_chat_template(msgs)
    assert a.eos_token_ids == b.eos_token_ids == [2]
    assert a.vocab_size == b.vocab_size
