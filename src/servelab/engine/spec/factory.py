"""Build speculative decoding for an engine: the proposer its config names, and the decoder.

``ngram`` needs nothing from the target. ``draft`` and ``self-draft`` run a model beside the
target, so the executor builds them (``Executor.draft_proposer``; the torch runner's lives in
``servelab.model.draft_model``): policy never imports torch or the model layer.
"""

from __future__ import annotations

from typing import Any

from servelab.engine.engine_config import EngineConfig
from servelab.engine.spec.decoder import SpeculativeDecoder
from servelab.engine.spec.ngram import NgramProposer
from servelab.engine.spec.policy import DraftLengthPolicy
from servelab.engine.spec.proposer import Proposer
from servelab.engine.spec.spec_config import SpeculativeConfig


def build_decoder(
    spec: SpeculativeConfig, executor: Any, config: EngineConfig, proposer: Proposer | None = None
) -> SpeculativeDecoder:
    """The decoder for an engine with resolved ``config``; ``proposer`` replaces the one
    ``spec.method`` names (EAGLE-style heads, tests)."""
    proposer = proposer if proposer is not None else build_proposer(spec, executor, config)
    policy = DraftLengthPolicy(spec.num_speculative_tokens, spec.adaptive)
    assert config.max_model_len is not None, "build_decoder takes a resolved config"
    return SpeculativeDecoder(proposer, policy, config.max_model_len)


def build_proposer(spec: SpeculativeConfig, executor: Any, config: EngineConfig) -> Proposer:
    """The proposer for ``spec``; ``config`` is the target engine's resolved config."""
    if spec.method == "ngram":
        lo, hi = spec.prompt_lookup_min, spec.prompt_lookup_max
        assert lo is not None and hi is not None, "SpeculativeConfig.from_dict sets both"
        return NgramProposer(lo, hi)
    build = getattr(executor, "draft_proposer", None)
    if build is None:
        raise ValueError(
            f"speculative method {spec.method!r} runs a model beside the target and needs the "
            f"torch model runner, not {type(executor).__name__}; use method 'ngram'"
        )
    return build(spec, config)
