"""Writing a GGUF the way llama.cpp's converter writes one, for the model tests.

``write_gguf`` converts an HF directory (the tiny random Llama or a variant) with
llama.cpp's Q/K row permutation and its tokenizer metadata, in fp32 or with its linear
weights in Q4_1 blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q/K of llama models."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _gguf_name(hf: str) -> str:
    stem, kind = hf.rsplit(".", 1)
    if stem in _TOP:
        return f"{_TOP[stem]}.{kind}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}.{kind}"


def write_gguf(hf_dir: Path, out: Path, q4_1: bool = False) -> Path:
    """A GGUF of ``hf_dir``'s model, fp32, or with its linear weights in Q4_1 blocks."""
    import gguf
    from gguf.quants import quantize
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = cfg["model_type"]
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())

    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i in special else 1 for _, i in vocab])
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_chat_template(tok_cfg["chat_template"])
    for name, arr in load_file(str(hf_dir / "model.safetensors")).items():
        if arch == "llama" and ".q_proj." in name:
            arr = llama_cpp_permute(arr, cfg["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            arr = llama_cpp_permute(arr, cfg["num_key_value_heads"])
        if q4_1 and name.split(".")[-2].endswith("_proj"):
            blocks = quantize(np.ascontiguousarray(arr), gguf.GGMLQuantizationType.Q4_1)
            w.add_tensor(_gguf_name(name), blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        else:
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
