"""Build speculative decoding for an engine: the proposer its config names, and the decoder.

``ngram`` needs nothing from the target. ``draft`` and ``self-draft`` need the torch model
runner (they share its device and, for self-draft, its weights); torch is imported only
for them. The draft pool holds as many blocks as the target's plus one per sequence, since a
draft context runs up to ``num_speculative_tokens`` positions past the target's.
"""

from __future__ import annotations

from typing import Any

from servelab.engine.config import EngineConfig
from servelab.engine.spec.config import SpeculativeConfig
from servelab.engine.spec.decoder import SpeculativeDecoder
from servelab.engine.spec.ngram import NgramProposer
from servelab.engine.spec.policy import DraftLengthPolicy
from servelab.engine.spec.proposer import Proposer


def build_decoder(
    spec: SpeculativeConfig, executor: Any, config: EngineConfig, proposer: Proposer | None = None
) -> SpeculativeDecoder:
    """The decoder for an engine with resolved ``config``; ``proposer`` replaces the one
    ``spec.method`` names (EAGLE-style heads, tests)."""
    proposer = proposer if proposer is not None else build_proposer(spec, executor, config)
    policy = DraftLengthPolicy(spec.num_speculative_tokens, spec.adaptive)
    return SpeculativeDecoder(proposer, policy, config.max_model_len)


def build_proposer(spec: SpeculativeConfig, executor: Any, config: EngineConfig) -> Proposer:
    """The proposer for ``spec``; ``config`` is the target engine's resolved config."""
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    from servelab.model.runner import TorchModelRunner

    if getattr(executor, "loaded", None) is None:  # the torch runner keeps its LoadedModel
        raise ValueError(
            f"speculative method {spec.method!r} runs a model beside the target and needs the "
            f"torch model runner, not {type(executor).__name__}; use method 'ngram'"
        )
    from servelab.engine.spec.draft_model import DraftModelProposer, self_draft_model

    if spec.method == "self-draft":
        loaded = self_draft_model(executor.loaded, spec.num_layers)
    else:
        loaded = _load_draft(spec.model, executor)
    runner = TorchModelRunner(loaded, device=executor.device, num_threads=executor.num_threads)
    num_blocks = config.num_kv_blocks + config.max_num_seqs
    return DraftModelProposer(runner, num_blocks, config.block_size)


def _load_draft(name: str, target: Any) -> Any:
    """Load the draft model and check that it speaks the target's token ids."""
    from servelab.model.loader import load_model

    draft = load_model(name, device=str(target.device))
    t_tok, d_tok = target.loaded.tokenizer, draft.tokenizer
    probe = "Speculative decoding: 12345, ünïcødé."
    if (
        d_tok.vocab_size != t_tok.vocab_size
        or d_tok.encode(probe) != t_tok.encode(probe)
        or draft.config.vocab_size != target.config.vocab_size
    ):
        raise ValueError(
            f"draft model {name!r} does not share the target's tokenizer and vocabulary "
            f"({d_tok.vocab_size} tokens, {draft.config.vocab_size} logits vs the target's "
            f"{t_tok.vocab_size}, {target.config.vocab_size}); pick a draft of the same family"
        )
    return draft
