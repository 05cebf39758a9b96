"""Load a model by short name, GGUF file or HF directory.

Contract: ``load_model(name_or_path, device=None, quantization="none")`` returns a
``LoadedModel`` with the config, the torch module (fp32, on ``device``: CUDA when present,
else CPU) and the tokenizer. A GGUF file is dequantised once into the weight cache
(``weight_cache``) and then loaded from there like any HF directory. ``quantization``
``bf16``, ``q8_0`` or ``q4_1`` keeps the linear weights in that form (``servelab.model.quant``);
those run on servelab's CPU kernels only, so they need a CPU device and the kernels built
(for ``bf16``, the AVX512-BF16 build).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from servelab.model.llama import LlamaForCausalLM
from servelab.modelcore.catalogue import is_gguf, resolve_model
from servelab.modelcore.config import ModelConfig
from servelab.modelcore.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    name: str
    path: Path  # what was resolved: the .gguf file or the HF directory
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    quantization: str = "none"

    @property
    def device(self) -> torch.device:
        return self.model.device


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


def _check_quantization(mode: str, dev: torch.device) -> None:
    from servelab.model import cpu_kernels
    from servelab.model.quant import check_mode

    check_mode(mode)
    if mode == "none":
        return
    if dev.type != "cpu":
        raise ValueError(
            f"--quantization {mode} runs on CPU only; use --quantization none on {dev}"
        )
    if not cpu_kernels.available():
        raise ValueError(
            f"--quantization {mode} needs servelab's CPU kernels (x86-64 with AVX2, FMA and "
            "F16C, a C compiler, SERVELAB_CPU_KERNELS not 0); use --quantization none here"
        )
    if mode == "bf16" and not cpu_kernels.bf16_dot_available():
        raise ValueError(
            "--quantization bf16 runs on servelab's AVX512-BF16 kernels, and this CPU or "
            "build has none (SERVELAB_CPU_ISA may narrow it); use --quantization none here"
        )


def load_model(
    name_or_path: str, device: str | None = None, quantization: str = "none"
) -> LoadedModel:
    """Load weights, config and tokenizer; see the module docstring."""
    t0 = time.perf_counter()
    dev = torch.device(device or default_device())
    _check_quantization(quantization, dev)
    path = resolve_model(name_or_path)
    hf_dir = path
    if is_gguf(path):
        from servelab.model.weight_cache import cached_hf_dir

        hf_dir = cached_hf_dir(path)
    config = ModelConfig.from_hf_dict(json.loads((hf_dir / "config.json").read_text()))
    # The GGUF's own metadata is the source of the tokenizer (the cache copy is identical).
    tokenizer = Tokenizer.from_model(str(path))
    weights = read_hf_weights(hf_dir)
    if quantization != "none":
        from servelab.model.quant import quantize

        weights = quantize(weights, quantization, path, config.num_heads, config.num_kv_heads)
    model = LlamaForCausalLM(config, weights, dev)
    log.info(
        "loaded %s (%s, weights %s) on %s in %.1f s",
        name_or_path, path, quantization, dev, time.perf_counter() - t0,
    )  # fmt: skip
    return LoadedModel(
        name=name_or_path, path=path, config=config, model=model, tokenizer=tokenizer,
        quantization=quantization,
    )  # fmt: skip
