"""Write a standard HF model directory (what transformers and vLLM load as-is).

Layout: ``config.json`` (LlamaForCausalLM / Qwen2ForCausalLM), ``model.safetensors``
(fp32), ``tokenizer.json``, ``tokenizer_config.json`` (with the chat template) and
``generation_config.json``. The GGUF weight cache (``weight_cache``) is such a directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from servelab.modelcore.catalogue import is_gguf, resolve_model
from servelab.modelcore.config import ModelConfig
from servelab.modelcore.tokenizer import Tokenizer

# Files of an HF directory that a copy keeps (weights are matched by suffix).
_HF_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "model.safetensors.index.json",
)


def write_hf_dir(
    config: ModelConfig, tensors: dict[str, np.ndarray], tokenizer: Tokenizer, out_dir: Path
) -> Path:
    """Write ``config``, fp32 ``tensors`` (HF names) and ``tokenizer`` into ``out_dir``."""
    from safetensors.numpy import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    tokenizer.backend.save(str(out_dir / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "add_bos_token": tokenizer.add_bos_token,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
        "chat_template": tokenizer.chat_template,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def export_hf(name_or_path: str, out_dir: str | Path) -> Path:
    """Write the model ``name_or_path`` (short name, .gguf or HF dir) as an HF directory."""
    src = resolve_model(name_or_path)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty; give a new or empty directory to export into")
    if is_gguf(src):
        from servelab.model.gguf_load import read_gguf

        config, tensors = read_gguf(str(src))
        return write_hf_dir(config, tensors, Tokenizer.from_model(str(src)), out)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name in _HF_FILES or f.suffix == ".safetensors":
            shutil.copy2(f, out / f.name)
    return out
