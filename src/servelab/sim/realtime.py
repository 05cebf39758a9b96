"""Real-time simulation: `servelab serve --simulate HARDWARE:MODEL`.

The server's engine core runs an ``LLMEngine`` (the engine's own scheduler and KV cache)
over a :class:`~servelab.sim.costs.executor.PacedExecutor`, which sleeps each step for the time
the cost model predicts on the simulated hardware. Clients get an OpenAI-compatible
server with that hardware's timing; the text is placeholder words from the serving
tokenizer, and generation runs to ``max_tokens`` (placeholders are never EOS).

Spec forms: ``h200:llama-3.1-8b``, ``h100:llama-3.1-70b:tp4``, ``profile:PATH.json``.
"""

from __future__ import annotations

import os
from typing import Any

from servelab.engine.engine_config import EngineConfig

ENV_VAR = "SERVELAB_SIMULATE"
_WORDS = " the quick brown fox jumps over the lazy dog and keeps on running through the field"


def build_target(spec: str, config: EngineConfig) -> Any:
    """A SimTarget from a ``--simulate`` spec; ValueError says which forms work."""
    from servelab.sim.sim_target import profile_target, roofline_target

    kind, _, rest = spec.partition(":")
    if kind == "profile":
        if not rest:
            raise ValueError("--simulate profile:PATH needs the profile table's path")
        return profile_target(rest, config)
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(
            f"--simulate {spec!r}: write HARDWARE:MODEL[:tpN] (e.g. h200:llama-3.1-8b, "
            "h100:llama-3.1-70b:tp4) or profile:PATH.json"
        )
    tp = 1
    if len(parts) == 3:
        if not (parts[2].startswith("tp") and parts[2][2:].isdigit()):
            raise ValueError(f"--simulate {spec!r}: the third part is tpN, e.g. tp2")
        tp = int(parts[2][2:])
    return roofline_target(parts[0], parts[1], tp=tp, engine_config=config)


def build_realtime_engine(spec: str, config: EngineConfig, tokenizer: Any) -> Any:
    """The paced engine for ``spec``, speaking ``tokenizer``'s ids (placeholder words)."""
    import dataclasses

    from servelab.engine.engine import LLMEngine

    target = build_target(spec, config)
    eos = list(tokenizer.eos_token_ids)
    words = [t for t in tokenizer.encode(_WORDS) if t not in eos] or [1000]
    target = dataclasses.replace(target, eos_token_ids=eos, placeholder_ids=words)
    return LLMEngine(target.make_executor(None), target.engine_config, tokenizer=tokenizer)


def build_engine(cfg: Any) -> Any:
    """Engine-core factory (``servelab.sim.realtime:build_engine``) for `servelab serve`.

    The spec comes from ``cfg.simulate`` when the core config has that field, else from
    the ``SERVELAB_SIMULATE`` environment variable; the tokenizer is ``cfg.model``'s.
    """
    from servelab.modelcore.tokenizer import Tokenizer

    spec = getattr(cfg, "simulate", None) or os.environ.get(ENV_VAR)
    if not spec:
        raise ValueError(f"no simulation spec: set --simulate HARDWARE:MODEL (or ${ENV_VAR})")
    return build_realtime_engine(spec, EngineConfig(**cfg.engine), Tokenizer.from_model(cfg.model))
