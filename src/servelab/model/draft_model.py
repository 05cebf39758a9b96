"""Draft-model proposer: a smaller model, with its own KV pool, guesses greedily.

The draft runs on its own ``TorchModelRunner`` and ``KVCacheManager`` (no prefix caching):
the same paged attention as the target, batched over all requests that propose this step.
Per request it remembers which tokens its cache holds K/V for (``_seen``): the verified
tokens plus its own earlier drafts. Each proposal

1. catches up: one forward over the tokens after the longest common prefix of ``_seen`` and
   the request's tokens (the newly verified ones; the whole context the first time), which
   samples the first draft;
2. then feeds each draft back, one token per forward, for the remaining drafts.

Positions past the common prefix are simply overwritten, so a rejection needs no roll-back.
Drafts are greedy (the argmax), i.e. a deterministic function of the context, as the
proposer contract requires.

``self_draft_model`` builds the "self-draft": the target's first L layers plus its final
norm and head, sharing the target's weight tensors (nothing is copied). ``build_draft_proposer``
is the torch runner's ``Executor.draft_proposer``: the draft pool holds as many blocks as the
target's plus one per sequence, since a draft context runs up to ``num_speculative_tokens``
positions past the target's.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from torch import nn

from servelab.engine.batch_plan import BatchPlan, ScheduledSeq
from servelab.engine.engine_config import EngineConfig
from servelab.engine.kv.kv_cache import KVCacheManager
from servelab.engine.sampling_params import SamplingParams
from servelab.engine.spec.proposer import DraftRequest
from servelab.engine.spec.spec_config import SpeculativeConfig
from servelab.model.loader import LoadedModel, load_model
from servelab.model.torch_runner import TorchModelRunner

_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


def self_draft_model(target: LoadedModel, num_layers: int) -> LoadedModel:
    """The target's first ``num_layers`` layers + its head, as a model sharing its weights."""
    model = target.model
    total = len(model.layers)
    if not 1 <= num_layers <= total:
        raise ValueError(
            f"self-draft num_layers must be between 1 and the target's {total} layers, "
            f"got {num_layers}"
        )
    # A shallow copy with its own module/parameter tables, so replacing `layers` on the view
    # leaves the target untouched; every tensor is the target's own.
    view = copy.copy(model)
    view._modules = dict(model._modules)
    view._parameters = dict(model._parameters)
    view._buffers = dict(model._buffers)
    view.layers = nn.ModuleList(list(model.layers[:num_layers]))
    view.config = dataclasses.replace(model.config, num_layers=num_layers)
    return dataclasses.replace(
        target, name=f"{target.name} (first {num_layers} layers)", config=view.config, model=view
    )


class DraftModelProposer:
    """Greedy drafts from a smaller model with its own KV pool (see the module docstring).

    ``num_blocks`` x ``block_size`` is the draft pool; a request that does not fit gets no
    drafts this step (the target decodes normally).
    """

    def __init__(self, runner: TorchModelRunner, num_blocks: int, block_size: int) -> None:
        self.runner = runner
        runner.allocate_kv(num_blocks, block_size)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self._seen: dict[str, list[int]] = {}  # tokens whose K/V the draft cache holds
        self._verified: dict[str, int] = {}  # len(token_ids) at the request's last proposal

    def propose(self, batch: list[DraftRequest]) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {}
        remaining: dict[str, int] = {}
        seqs: list[ScheduledSeq] = []
        for r in batch:
            seq = self._catch_up(r)
            if seq is not None:
                seqs.append(seq)
                drafts[r.request_id] = []
                remaining[r.request_id] = r.max_tokens
        step = 0
        while seqs:
            sampled = self.runner.execute(BatchPlan(step, seqs)).sampled
            step += 1
            seqs = []
            for rid, (tok, *_) in sampled.items():
                drafts[rid].append(tok)
                remaining[rid] -= 1
                if remaining[rid]:
                    seen = self._seen[rid]
                    seqs.append(self._seq(rid, [tok], len(seen)))
                    seen.append(tok)
        return drafts

    def remove(self, request_id: str) -> None:
        self._seen.pop(request_id, None)
        self._verified.pop(request_id, None)
        self.kv.free(request_id)

    def _catch_up(self, r: DraftRequest) -> ScheduledSeq | None:
        """The first forward of a proposal for ``r``, or None if it cannot run."""
        rid, ids = r.request_id, r.token_ids
        # Positions up to the last token's plus the drafts fed back (all but the last).
        need = len(ids) + r.max_tokens - 1
        if need > self.runner.max_model_len or not self.kv.allocate(rid, need):
            self.remove(rid)
            return None
        seen = self._seen.setdefault(rid, [])
        # token_ids only grows, so its length at the last proposal is a known common prefix;
        # only the drafts after it need comparing.
        common = self._verified.get(rid, 0)
        limit = min(len(seen), len(ids))
        while common < limit and seen[common] == ids[common]:
            common += 1
        del seen[common:]
        seen.extend(ids[common:])
        self._verified[rid] = len(ids)
        start = min(common, len(ids) - 1)  # the last token is always fed: it samples a draft
        return self._seq(rid, ids[start:], start)

    def _seq(self, request_id: str, token_ids: list[int], start: int) -> ScheduledSeq:
        return ScheduledSeq(
            request_id=request_id,
            token_ids=token_ids,
            start_pos=start,
            block_table=list(self.kv.block_table(request_id)),
            sample=True,
            sampling=_GREEDY,
        )


def build_draft_proposer(
    target: TorchModelRunner, spec: SpeculativeConfig, config: EngineConfig
) -> DraftModelProposer:
    """The ``draft`` or ``self-draft`` proposer for ``target``, on its device and threads."""
    if spec.method == "self-draft":
        loaded = self_draft_model(target.loaded, spec.num_layers)
    else:
        loaded = _load_draft(spec.model, target)
    runner = TorchModelRunner(loaded, device=target.device, num_threads=target.num_threads)
    num_blocks = config.num_kv_blocks + config.max_num_seqs
    return DraftModelProposer(runner, num_blocks, config.block_size)


def _load_draft(name: str, target: Any) -> LoadedModel:
    """Load the draft model and check that it speaks the target's token ids."""
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
