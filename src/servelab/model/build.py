"""A real engine on a real model: load the weights, put the torch runner under ``LLMEngine``.

The engine layer never loads a model (policy imports no torch); everything that wants an
engine on weights (`servelab generate`, the server's core, the profiler, ``LLM``) builds it
here. Imports nothing heavy at module level.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from servelab.engine.engine_config import EngineConfig
from servelab.vocab import DEFAULT_MODEL

if TYPE_CHECKING:
    from servelab.engine.engine import LLMEngine


def build_engine(
    model: str = DEFAULT_MODEL,
    config: EngineConfig | None = None,
    device: str | None = None,
    threads: int | None = None,
    engine_cls: type[LLMEngine] | None = None,
    quantization: str = "none",
) -> LLMEngine:
    """Load ``model`` (short name, .gguf or HF directory) and build an engine on it.

    ``threads`` torch/BLAS threads; None keeps what the process has (torch's default, or
    what the caller set). ``engine_cls`` is ``LLMEngine`` or a subclass of it (a
    disaggregated worker's engine). ``quantization``: none (fp32), q8_0 or q4_1 weights
    (``servelab.model.quant``).
    """
    from servelab.engine.engine import LLMEngine
    from servelab.model.loader import load_model
    from servelab.model.torch_runner import TorchModelRunner

    loaded = load_model(model, device=device, quantization=quantization)
    runner = TorchModelRunner(loaded, device=device, num_threads=threads)
    cls = engine_cls or LLMEngine
    return cls(runner, config or EngineConfig(), tokenizer=loaded.tokenizer)
