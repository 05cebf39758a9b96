"""Registry and tokenizer: name resolution, GGUF-built tokenizer vs references, chat template."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from model_helpers import ROUND_TRIP_TEXTS

from servelab.modelcore.catalogue import resolve_model
from servelab.modelcore.tokenizer import Tokenizer


def test_unknown_model_name_says_what_exists() -> None:
    with pytest.raises(ValueError, match="smollm2-135m") as info:
        resolve_model("no-such-model")
    assert ".gguf" in str(info.value) and "HF directory" in str(info.value)


def test_directory_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))


def test_paths_pass_through(tiny_llama_dir: Path, smollm2_path: Path) -> None:
    assert resolve_model(str(tiny_llama_dir)) == tiny_llama_dir
    assert resolve_model(str(smollm2_path)) == smollm2_path
    assert smollm2_path.suffix == ".gguf" and smollm2_path.is_file()


def test_tokenizer_does_not_import_torch(smollm2_path: Path) -> None:
    code = (
        "import sys; from servelab.modelcore.tokenizer import Tokenizer; "
        "Tokenizer.from_model('smollm2-135m').encode('hi'); "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_hf_dir_tokenizer_round_trips(tiny_llama_dir: Path) -> None:
    tok = Tokenizer.from_model(str(tiny_llama_dir))
    assert tok.vocab_size == 400
    assert tok.eos_token_ids == [2]
    for text in ROUND_TRIP_TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_end|>") == [2]
    assert tok.decode([1, *tok.encode("hi"), 2]) == "hi"


def test_gguf_tokenizer_basics(smollm2_path: Path) -> None:
    tok = Tokenizer.from_model("smollm2-135m")
    assert tok.vocab_size == 49152
    assert tok.eos_token_ids == [2]
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("hello", add_special_tokens=True) == tok.encode("hello")  # no BOS for SmolLM2
    for text in ROUND_TRIP_TEXTS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_chat_template_renders(smollm2_path: Path) -> None:
    tok = Tokenizer.from_model("smollm2-135m")
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}],
        add_generation_prompt=False,
    )
    assert no_prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nx<|im_end|>\n"
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])


@pytest.mark.slow
def test_gguf_tokenizer_matches_transformers_gguf_conversion(smollm2_path: Path) -> None:
    """An independent reference: transformers builds its own tokenizer from the same GGUF."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    tok = Tokenizer.from_model(str(smollm2_path))
    for text in ROUND_TRIP_TEXTS:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text
