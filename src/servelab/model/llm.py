"""The offline API: ``LLM(model).generate(prompts, params)``, like vLLM's ``LLM``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from servelab.engine.engine import LLMEngine
from servelab.engine.engine_config import EngineConfig
from servelab.engine.sampling_params import SamplingParams
from servelab.model.build import build_engine
from servelab.vocab import DEFAULT_MODEL, FinishReason, RequestTimeline


@dataclass
class GenerationResult:
    """One prompt's completion."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    timeline: RequestTimeline


class LLM:
    """Generate for a batch of prompts with continuous batching on one engine.

    ``LLM(model=DEFAULT_MODEL, device=None, **engine_config_kwargs)``: the keyword arguments
    are ``EngineConfig`` fields (``max_num_batched_tokens``, ``enable_prefix_caching``, ...).
    """

    def __init__(
        self, model: str = DEFAULT_MODEL, device: str | None = None, **engine_config_kwargs: Any
    ):
        unknown = set(engine_config_kwargs) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise TypeError(
                f"unknown engine option(s) {sorted(unknown)}; valid: "
                f"{sorted(EngineConfig.__dataclass_fields__)}"
            )
        self.engine = build_engine(model, EngineConfig(**engine_config_kwargs), device=device)
        self._counter = 0

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an existing engine (e.g. one on a test executor)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._counter = 0
        return llm

    def generate(
        self,
        prompts: Sequence[str] | Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Run every prompt to completion; results are in prompt order.

        ``prompts`` are texts or token-id lists; ``params`` is one SamplingParams for all or
        one per prompt. Raises RuntimeError if the engine failed a request.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        engine = self.engine
        ids: list[str] = []
        for prompt, sp in zip(prompts, params):
            rid = f"gen-{self._counter}"
            self._counter += 1
            if isinstance(prompt, str):
                engine.add_request(rid, prompt=prompt, sampling_params=sp)
            else:
                engine.add_request(rid, prompt_token_ids=list(prompt), sampling_params=sp)
            ids.append(rid)
        prompt_ids = {rid: engine.get_request(rid).prompt_token_ids for rid in ids}
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        texts: dict[str, list[str]] = {rid: [] for rid in ids}
        done: dict[str, GenerationResult] = {}
        while len(done) < len(ids):
            for out in engine.step().outputs:
                rid = out.request_id
                tokens[rid] += out.new_token_ids
                texts[rid].append(out.new_text)
                if not out.finished:
                    continue
                if out.finish_reason is FinishReason.ERROR:
                    for other in ids:
                        engine.abort(other)
                    raise RuntimeError(f"the engine failed request {rid}: {out.timeline.error}")
                done[rid] = GenerationResult(
                    rid,
                    prompt_ids[rid],
                    tokens[rid],
                    "".join(texts[rid]),
                    out.finish_reason,
                    out.timeline,
                )
        return [done[rid] for rid in ids]
