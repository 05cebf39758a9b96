"""A request as the engine's policy layer sees it. Pure Python (the simulator reuses it).

Contract:
- ``token_ids`` is the prompt followed by every output token so far; ``num_computed_tokens``
  of them have K/V in the paged cache. The pending tokens ``token_ids[num_computed_tokens:]``
  are what the next step must compute: the rest of the prompt during prefill, the last
  sampled token during decode, everything again after a preemption (recompute).
- ``phase`` is the docs/design/overview.md lifecycle: QUEUED until admitted, PREFILL until the step that
  samples, then DECODE; a preemption sends it back to QUEUED with its output kept.
- ``spec_token_ids`` are draft tokens proposed for the next step (speculative decoding).
  They are never part of ``token_ids``: the scheduler appends only the ones the executor
  verified, and clears them after every step and at preemption.
- ``admit_seq`` orders admissions (larger = admitted more recently); the scheduler preempts
  the lowest priority first, then the most recently admitted.

``RequestOutput`` is what the engine returns for a request after each step.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelab.engine.sampling_params import SamplingParams
from servelab.vocab import FinishReason, Phase, RequestTimeline


class Request:
    """One generation request: its tokens, progress, phase and timeline."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: list[int],
        arrival_time: float,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        # An attribute, not a property: the prompt never changes and the engine reads this
        # for every sequence of every step.
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = list(eos_token_ids)
        self.priority = priority
        self.num_computed_tokens = 0
        self.phase = Phase.QUEUED
        self.admit_seq = -1
        # Prompt tokens served from the prefix cache at the latest admission; reported with
        # the first prefill chunk after that admission, then cleared.
        self.pending_cached_tokens = 0
        self.spec_token_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.timeline = RequestTimeline(
            request_id=request_id,
            arrival=arrival_time,
            priority=priority,
            prompt_tokens=len(prompt_token_ids),
            queued=[arrival_time],
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    def banned_token_ids(self) -> list[int]:
        """Ids the next sample must not take: EOS (unless ignored) and stop ids before min_tokens."""
        sp = self.sampling_params
        if self.num_output_tokens >= sp.min_tokens:
            return []
        banned = list(sp.stop_token_ids)
        if not sp.ignore_eos:
            banned += self.eos_token_ids
        return banned

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, phase={self.phase.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, priority={self.priority})"
        )


@dataclass(slots=True, init=False)
class RequestOutput:
    """What one step produced for one request. Built in one place, from the request:
    ``RequestOutput(req, tokens, text, reason)`` after ``tokens`` (and ``text``) joined
    ``req``; ``reason`` is why it finished, None while it goes on."""

    request_id: str
    new_token_ids: list[int]  # tokens produced this step (several with speculative decoding)
    new_text: str  # detokenized text for them ("" without a tokenizer); stop strings trimmed
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    timeline: RequestTimeline  # complete once finished

    # Its own constructor, not the fields': the engine builds one per sequence per step, and
    # a call to the generated one by keywords costs about twice this.
    def __init__(
        self, req: Request, tokens: list[int], text: str, reason: FinishReason | None
    ) -> None:
        self.request_id = req.request_id
        self.new_token_ids = tokens
        self.new_text = text
        self.finished = reason is not None
        self.finish_reason = reason
        self.num_prompt_tokens = req.num_prompt_tokens
        self.num_output_tokens = len(req.token_ids) - req.num_prompt_tokens
        self.timeline = req.timeline
