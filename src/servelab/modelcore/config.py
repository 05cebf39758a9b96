"""The model's shape, read from an HF ``config.json`` or a GGUF file's metadata. No torch.

Contract: ``ModelConfig.from_hf_dict`` accepts transformers v4 (``rope_theta`` +
``rope_scaling``) and v5 (``rope_parameters``) configs of Llama, Mistral, Qwen2 and
SmolLM; ``to_hf_dict`` writes a v4-style LlamaForCausalLM/Qwen2ForCausalLM config that
both transformers generations and vLLM read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHS = {"llama", "mistral", "qwen2", "smollm", "smollm2"}
ROPE_TYPES = {"default", "linear", "dynamic", "yarn", "llama3"}


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": ..., "factor": ..., ...}
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_ARCHS:
            raise ValueError(
                f"model type {self.model_type!r} is not supported; servelab runs Llama-family "
                f"decoders ({', '.join(sorted(SUPPORTED_ARCHS))})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        rope_type = self.rope_type
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope scaling {rope_type!r} is not supported (supported: {sorted(ROPE_TYPES)})"
            )

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type") or self.rope_scaling.get("type") or "default"

    @property
    def max_model_len(self) -> int:
        """Longest sequence served. Sliding-window attention is not implemented, so a
        model that uses it is capped at its window (exact up to there)."""
        if self.sliding_window and self.sliding_window < self.max_position_embeddings:
            return self.sliding_window
        return self.max_position_embeddings

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, list):
            return list(self.eos_token_id)
        return [self.eos_token_id]

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        rope_theta = cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling")
        params = cfg.get("rope_parameters")  # transformers v5
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            kind = params.get("rope_type", "default")
            scaling = (
                None
                if kind == "default"
                else {k: v for k, v in params.items() if k != "rope_theta"}
            )
        if scaling and "rope_type" not in scaling and "type" in scaling:
            scaling = {**scaling, "rope_type": scaling["type"]}
        heads = cfg["num_attention_heads"]
        sliding = cfg.get("sliding_window")
        if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
            sliding = None  # Qwen2 configs name a window they do not use
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling or None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            sliding_window=sliding,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
        arch = meta.get("general.architecture", "llama")
        if arch not in ("llama", "qwen2"):
            raise ValueError(
                f"GGUF architecture {arch!r} is not supported (llama and qwen2 are); "
                "use the model's HF directory instead"
            )

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{key}", default)

        hidden = get("embedding_length")
        heads = get("attention.head_count")
        scaling = None
        kind = get("rope.scaling.type")
        if kind and kind != "none":
            if "rope_freqs.weight" in tensor_names:
                raise ValueError(
                    "this GGUF stores precomputed RoPE frequency factors (rope_freqs), which "
                    "servelab does not read; use the model's HF directory instead"
                )
            scaling = {"rope_type": kind, "factor": get("rope.scaling.factor", 1.0)}
            orig = get("rope.scaling.original_context_length")
            if orig:
                scaling["original_max_position_embeddings"] = orig
        vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
        return cls(
            model_type=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_layers=get("block_count"),
            num_heads=heads,
            num_kv_heads=get("attention.head_count_kv") or heads,
            head_dim=get("attention.key_length") or get("rope.dimension_count") or hidden // heads,
            max_position_embeddings=get("context_length", 2048),
            rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings="output.weight" not in tensor_names,
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A standard config.json (v4 style; transformers v5 and vLLM read it as well)."""
        qwen = self.model_type == "qwen2"
        cfg: dict[str, Any] = {
            "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
            "model_type": "qwen2" if qwen else "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if not qwen:
            cfg["attention_bias"] = self.qkv_bias
            cfg["mlp_bias"] = False
        if self.sliding_window:
            cfg["sliding_window"] = self.sliding_window
        return cfg
