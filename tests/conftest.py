"""Shared fixtures: a tiny random Llama HF directory, and the real default model.

- ``tiny_llama_dir``: a session-wide HF directory (config.json, model.safetensors,
  tokenizer.json, tokenizer_config.json with a ChatML template, generation_config.json)
  of a 2-layer random Llama whose vocabulary is exactly its tokenizer's (~400 ids).
  Loads in well under a second; use it wherever real weights are not the point.
- ``make_tiny_llama(**config_overrides)``: the same, with config changes (e.g.
  ``attention_bias=True``, ``tie_word_embeddings=False``, ``model_type="qwen2"``).
- ``smollm2_path``: the real SmolLM2-135M GGUF (skips if its package is missing).
- ``tiny_tok`` / ``smollm_tok``: the tokenizer of the tiny Llama / of SmolLM2-135M (the
  latter skips if its package is missing), loaded once per session.
- ``server`` / ``http``: a fake-engine server of the tiny model (``server_helpers.serving``)
  and an HTTP client on it, one per test module. ``http`` talks to whatever ``server`` the
  module has, so a module that serves something else overrides ``server`` alone.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

if TYPE_CHECKING:
    from server_helpers import ServerThread

    from servelab.modelcore.tokenizer import Tokenizer

# Tests interrupt child CLIs with SIGINT and expect Ctrl-C handling (exit 130). A suite
# started as a background job of a non-interactive shell (`nohup .ci/run &`) inherits SIGINT
# ignored, and every child would inherit that too; a handled signal is reset to the default
# across exec, so the children get Python's KeyboardInterrupt again.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefill computes the prompt; decode produces one token per step.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Continuous batching mixes prefill chunks with decode steps of other requests.",
    "Hello world! How are you today? I am fine, thank you.",
    "Numbers like 12345 and 3.14159 are split into digits.",
    "Unicode text: ünïcødé, 日本語, emoji 😀.",
]


def _write_tokenizer(out: Path) -> int:
    """Train a small byte-level BPE on a fixed corpus; return its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHATML_TEMPLATE,
                "model_max_length": 2048,
            }
        )
    )
    return tok.get_vocab_size()


def write_tiny_llama(out: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random Llama-family HF directory into ``out`` and return it."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    vocab = _write_tokenizer(out)
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    cfg.update(overrides)
    if cfg["model_type"] == "qwen2":
        cfg["architectures"] = ["Qwen2ForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    qkv_bias = cfg["attention_bias"] or cfg["model_type"] == "qwen2"
    tensors = {
        "model.embed_tokens.weight": rand(vocab, h, std=1.0),
        "model.norm.weight": 1 + rand(h),
    }
    if not cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rand(vocab, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": 1 + rand(h),
            p + "post_attention_layernorm.weight": 1 + rand(h),
            p + "self_attn.q_proj.weight": rand(nq * hd, h),
            p + "self_attn.k_proj.weight": rand(nkv * hd, h),
            p + "self_attn.v_proj.weight": rand(nkv * hd, h),
            p + "self_attn.o_proj.weight": rand(h, nq * hd),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
        }
        if qkv_bias:
            tensors |= {
                p + "self_attn.q_proj.bias": rand(nq * hd),
                p + "self_attn.k_proj.bias": rand(nkv * hd),
                p + "self_attn.v_proj.bias": rand(nkv * hd),
            }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def make_tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    def make(**overrides: Any) -> Path:
        return write_tiny_llama(tmp_path_factory.mktemp("tiny_variant"), **overrides)

    return make


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from servelab.modelcore.catalogue import DEFAULT_MODEL, resolve_model

    try:
        return resolve_model(DEFAULT_MODEL)
    except ValueError as e:
        pytest.skip(f"default model not installed: {e}")


@pytest.fixture(scope="session")
def tiny_tok(tiny_llama_dir: Path) -> Tokenizer:
    from servelab.modelcore.tokenizer import Tokenizer

    return Tokenizer.from_model(str(tiny_llama_dir))


@pytest.fixture(scope="session")
def smollm_tok() -> Tokenizer:
    from servelab.modelcore.tokenizer import Tokenizer

    try:
        return Tokenizer.from_model("smollm2-135m")
    except ValueError as e:
        pytest.skip(f"default model not installed: {e}")


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[ServerThread]:
    from server_helpers import serving

    with serving(tiny_llama_dir) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client
