"""Decoder shapes for the cost models: parameter counts, the FLOPs of a step's work, the
bytes of the weights it streams, and KV bytes per token.

A :class:`ModelSpec` comes from a preset name, or from an HF ``config.json`` (a file or a
directory holding one) or a GGUF file. A ``config.json`` is read for its shapes whatever its
``model_type`` (Qwen3, Mixtral, Llama 4 text...), as long as they are the standard keys;
mixture-of-experts layers come from ``num_local_experts`` and ``num_experts_per_tok``. Only
shapes matter here: no weights are read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from servelab.modelcore.config import ModelConfig

if TYPE_CHECKING:
    from servelab.sim.costs.work import StepWork


@dataclass(frozen=True)
class ModelSpec:
    """The shapes of a Llama-style decoder (Llama, Mistral, Qwen2/3, SmolLM, Mixtral).

    ``qkv_bias`` adds the q/k/v biases Qwen2 has. Parameter counts include norms. With
    ``experts`` > 0 every layer's gated MLP is that many experts of ``intermediate`` columns
    (plus a router), of which each token runs ``experts_per_token``, and
    ``shared_intermediate`` columns of a shared expert every token runs (Llama 4). Tensor
    parallelism splits every expert's columns, as vLLM does without expert parallelism.
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    max_model_len: int
    qkv_bias: bool = False
    experts: int = 0
    experts_per_token: int = 0
    shared_intermediate: int = 0

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_matrix_params(self) -> int:
        """Weights of one decoder layer's matrices: the q/k/v/o projections and the gated MLP
        (what a weight-only quantisation stores in its own format)."""
        return self._attn_matrix_params + self._mlp_params(max(self.experts, 1))

    @property
    def _attn_matrix_params(self) -> int:
        h = self.hidden
        return h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h

    def _mlp_params(self, experts: int) -> int:
        """One layer's MLP weights with ``experts`` routed experts (1: a dense MLP)."""
        h = self.hidden
        router = h * self.experts
        return 3 * h * (self.intermediate * experts + self.shared_intermediate) + router

    @property
    def active_layer_params(self) -> int:
        """Weights of one layer one token multiplies through: all of a dense layer; the
        attention, router, shared expert and ``experts_per_token`` experts of an MoE layer."""
        if not self.experts:
            return self.layer_params
        return (
            self.layer_params
            - self._mlp_params(self.experts)
            + self._mlp_params(self.experts_per_token)
        )

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer: attention projections, gated MLP, two RMSNorms."""
        bias = self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0
        return self.layer_matrix_params + bias + 2 * self.hidden

    @property
    def linear_params_per_token(self) -> int:
        """All layers' weights (every expert of an MoE layer; not the LM head): what the
        layers hold and, since a batch of a dozen tokens already reaches every expert of a
        top-2-of-8 layer, what a step streams."""
        return self.layers * self.layer_params

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def num_params(self) -> int:
        """Total parameters: embedding, layers, final norm, and the LM head unless tied."""
        emb = self.vocab * self.hidden
        head = 0 if self.tied_embeddings else self.lm_head_params
        return emb + self.layers * self.layer_params + self.hidden + head

    @property
    def streamed_params(self) -> int:
        """Weights one forward pass reads in full: the layers, the final norm and the LM
        head. The input embedding is only indexed (one row per token)."""
        return self.layers * self.layer_params + self.hidden + self.lm_head_params

    @property
    def flops_per_token(self) -> int:
        """FLOPs of the layers for one computed token: 2 per weight it multiplies through
        (every layer's matrices, norms and biases, only the routed experts of an MoE layer;
        not the LM head)."""
        return 2 * self.layers * self.active_layer_params

    @property
    def flops_per_logit(self) -> int:
        """FLOPs of the LM head for one position whose logits are computed."""
        return 2 * self.lm_head_params

    @property
    def flops_per_attn_pair(self) -> int:
        """FLOPs of attention for one causal (query, key) pair over all layers: the score
        and the value products, 2 each per head element."""
        return 4 * self.layers * self.heads * self.head_dim

    def flops(self, work: StepWork) -> float:
        """FLOPs of one step's work on one device: the layers over every computed token,
        the LM head over the positions with logits, attention over the causal pairs."""
        return (
            self.flops_per_token * work.tokens
            + self.flops_per_logit * work.logits
            + self.flops_per_attn_pair * work.attn_pairs
        )

    def streamed_bytes(self, matrix_bytes: float, head_bytes: float, other_bytes: float) -> float:
        """Bytes of the weights one forward pass streams (``streamed_params``), with the
        layers' matrices at ``matrix_bytes`` a weight, the LM head at ``head_bytes`` and the
        rest (norms, biases) at ``other_bytes``: a quantised model's three datatypes."""
        matrices = self.layers * self.layer_matrix_params
        other = self.streamed_params - matrices - self.lm_head_params
        return matrices * matrix_bytes + self.lm_head_params * head_bytes + other * other_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token across all layers."""
        return 2 * self.layers * self.kv_dim * dtype_bytes

    def weight_bytes(self, dtype_bytes: int) -> int:
        return self.num_params * dtype_bytes


PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        # Shapes from each model's published config.json on the Hugging Face hub.
        ModelSpec("llama-3.1-8b", 4096, 32, 32, 8, 128, 14336, 128256, False, 131072),
        ModelSpec("llama-3.1-70b", 8192, 80, 64, 8, 128, 28672, 128256, False, 131072),
        ModelSpec("llama-3.3-70b", 8192, 80, 64, 8, 128, 28672, 128256, False, 131072),
        ModelSpec("llama-3-8b", 4096, 32, 32, 8, 128, 14336, 128256, False, 8192),
        ModelSpec("llama-3-70b", 8192, 80, 64, 8, 128, 28672, 128256, False, 8192),
        ModelSpec("qwen2.5-7b", 3584, 28, 28, 4, 128, 18944, 152064, False, 32768, qkv_bias=True),
        ModelSpec("qwen2.5-32b", 5120, 64, 40, 8, 128, 27648, 152064, False, 32768, qkv_bias=True),
        ModelSpec("smollm2-135m", 576, 30, 9, 3, 64, 1536, 49152, True, 8192),
    )
}


def from_model_config(cfg: ModelConfig, name: str) -> ModelSpec:
    """The shapes of a model package ``ModelConfig`` (its context: ``max_model_len``)."""
    return ModelSpec(
        name=name,
        hidden=cfg.hidden_size,
        layers=cfg.num_layers,
        heads=cfg.num_heads,
        kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate=cfg.intermediate_size,
        vocab=cfg.vocab_size,
        tied_embeddings=cfg.tie_word_embeddings,
        max_model_len=cfg.max_model_len,
        qkv_bias=cfg.qkv_bias,
    )


def spec_from_hf_config(d: dict[str, Any], name: str) -> ModelSpec:
    """The shapes of an HF ``config.json`` (a dict) whatever its ``model_type``.

    Reads the standard keys (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``intermediate_size``, ``vocab_size``; ``num_key_value_heads``, ``head_dim``,
    ``max_position_embeddings``, ``tie_word_embeddings``, ``attention_bias`` when given),
    a ``text_config`` inside a multimodal one, and the experts of an MoE
    (``num_local_experts`` or ``num_experts``, ``num_experts_per_tok``, a shared expert of
    ``intermediate_size`` when ``num_shared_experts``/``shared_experts`` is set). Raises
    ValueError naming a missing key.
    """
    if isinstance(d.get("text_config"), dict):
        d = {**d, **d["text_config"]}
    try:
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        experts = int(d.get("num_local_experts") or d.get("num_experts") or 0)
        shared = int(d.get("num_shared_experts") or d.get("shared_experts") or 0)
        max_len = int(d.get("max_position_embeddings", 2048))
        window = d.get("sliding_window")
        if d.get("model_type") == "qwen2" and not d.get("use_sliding_window", False):
            window = None  # Qwen2 configs name a window they do not use
        if window and int(window) < max_len:
            max_len = int(window)  # as the engine serves it: capped at the window
        return ModelSpec(
            name=name,
            hidden=hidden,
            layers=int(d["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            intermediate=int(d["intermediate_size"]),
            vocab=int(d["vocab_size"]),
            tied_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_model_len=max_len,
            qkv_bias=d.get("model_type") == "qwen2" or bool(d.get("attention_bias", False)),
            experts=experts,
            experts_per_token=int(d.get("num_experts_per_tok") or 0) if experts else 0,
            shared_intermediate=shared * int(d["intermediate_size"]) if experts else 0,
        )
    except KeyError as e:
        raise ValueError(
            f"config.json of {name!r} lacks {e.args[0]!r}; the simulator needs hidden_size, "
            "num_hidden_layers, num_attention_heads, intermediate_size and vocab_size"
        ) from None


def _from_gguf(path: Path) -> ModelSpec:
    from servelab.modelcore.gguf_meta import read_metadata, tensor_names

    names = set(tensor_names(path))
    return from_model_config(ModelConfig.from_gguf_metadata(read_metadata(path), names), path.stem)


def load_model_spec(name_or_path: str) -> ModelSpec:
    """A preset name, an HF ``config.json`` (or its directory), or a ``.gguf`` file.

    Raises ValueError naming the presets when nothing matches.
    """
    key = name_or_path.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".gguf" and path.is_file():
        return _from_gguf(path)
    if path.suffix == ".json" and path.is_file():
        name = path.parent.name if path.name == "config.json" else path.stem
        return spec_from_hf_config(json.loads(path.read_text()), name)
    raise ValueError(
        f"unknown model {name_or_path!r}; presets: {', '.join(sorted(PRESETS))}. "
        "Or pass an HF config.json, a directory holding one, or a .gguf file."
    )
