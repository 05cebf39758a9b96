"""Dequantise a GGUF file into HF-named fp32 arrays (numpy; no torch).

llama.cpp's converter permutes the rows of Q and K of ``llama`` models so that rotary
pairs are adjacent (GPT-J style); HF checkpoints keep the two halves of each head apart
(``rotate_half``). ``read_gguf`` undoes that permutation, so the result is a standard HF
checkpoint. Qwen2 GGUFs are not permuted.
"""

from __future__ import annotations

import logging

import numpy as np

from servelab.modelcore.config import ModelConfig
from servelab.modelcore.gguf_meta import read_metadata

log = logging.getLogger(__name__)

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None if unused."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP:
        return f"{_TOP[parts[0]]}.{parts[1]}"
    return None


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K row permutation (adjacent pairs -> two half-heads)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """The config and the dequantised HF-named fp32 tensors of a GGUF file."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    config = ModelConfig.from_gguf_metadata(read_metadata(path), names)
    tensors: dict[str, np.ndarray] = {}
    for i, t in enumerate(reader.tensors):
        name = hf_name(t.name)
        if name is None:
            continue
        arr = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if config.model_type == "llama" and ".self_attn.q_proj." in name:
            arr = unpermute_rotary(arr, config.num_heads)
        elif config.model_type == "llama" and ".self_attn.k_proj." in name:
            arr = unpermute_rotary(arr, config.num_kv_heads)
        tensors[name] = np.ascontiguousarray(arr)
        if i % 64 == 0:
            log.info("dequantising %s: %d/%d tensors", path, i, len(reader.tensors))
    return config, tensors
