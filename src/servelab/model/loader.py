"""Load a model by short name, GGUF file or HF directory.

Contract: ``load_model(name_or_path, device=None)`` returns a ``LoadedModel`` with the
config, the torch module (fp32, on ``device``: CUDA when present, else CPU) and the
tokenizer. A GGUF file is dequantised once into the weight cache (``weight_cache``) and
then loaded from there like any HF directory.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from servelab.model.config import ModelConfig
from servelab.model.llama import LlamaForCausalLM
from servelab.model.registry import is_gguf, resolve_model
from servelab.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    name: str
    path: Path  # what was resolved: the .gguf file or the HF directory
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer

    @property
    def device(self) -> torch.device:
        return self.model.embed.device


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of the directory's safetensors files, as fp32 on CPU."""
    from safetensors.torch import load_file

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{hf_dir} has no *.safetensors weights; servelab reads safetensors only")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            weights[name] = t if t.dtype == torch.float32 else t.float()
    return weights


def load_model(name_or_path: str, device: str | None = None) -> LoadedModel:
    """Load weights, config and tokenizer; see the module docstring."""
    t0 = time.perf_counter()
    path = resolve_model(name_or_path)
    hf_dir = path
    if is_gguf(path):
        from servelab.model.weight_cache import cached_hf_dir

        hf_dir = cached_hf_dir(path)
    config = ModelConfig.from_hf_dict(json.loads((hf_dir / "config.json").read_text()))
    # The GGUF's own metadata is the source of the tokenizer (the cache copy is identical).
    tokenizer = Tokenizer.from_model(str(path))
    dev = torch.device(device or default_device())
    model = LlamaForCausalLM(config, read_hf_weights(hf_dir), dev)
    log.info("loaded %s (%s) on %s in %.1f s", name_or_path, path, dev, time.perf_counter() - t0)
    return LoadedModel(
        name=name_or_path, path=path, config=config, model=model, tokenizer=tokenizer
    )
