"""The server around the engine: what a request and its streamed tokens wait for besides the
engine's own steps.

An OpenAI-compatible server such as vLLM's runs an API process in front of the engine core.
A request is parsed and tokenised there before the core's scheduler sees it, and each
step's new tokens go back through an output processor (detokenisation, the stream) that
runs while the core already runs the next step; with asynchronous scheduling a step's
tokens reach the API process a step late. Neither is engine work, so neither is in a
step's predicted time: :class:`ServingPath` states them as parameters the simulation loop
applies (``sim.loop.simulation``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ServingPath:
    """``per_request`` seconds and ``per_prompt_token`` seconds per prompt token between a
    request reaching the server and reaching the engine (HTTP, tokenisation, the hand-over
    to the core): the scheduler sees it that much later. ``output_steps``: each streamed
    chunk reaches the client that many of its step's durations after the step ends (the
    output processor and the step lag of asynchronous scheduling). ``burst_share``: of the
    requests reaching an idle engine at one instant, the share (at least one request) the
    server has handed to the engine when its first step starts; the rest join the next step
    (the front end takes a burst one request at a time while the engine starts on the
    first: ``sim.fit.first_step``). ``source`` says where the values come from.
    """

    per_request: float = 0.0
    per_prompt_token: float = 0.0
    output_steps: float = 0.0
    burst_share: float = 1.0
    source: str = ""

    def __post_init__(self) -> None:
        if min(self.per_request, self.per_prompt_token, self.output_steps) < 0:
            raise ValueError("serving-path delays must be >= 0")
        if not 0 < self.burst_share <= 1:
            raise ValueError("a serving path's burst share must be in (0, 1]")

    def first_step(self, burst: int) -> int:
        """How many of ``burst`` requests reaching an idle engine at one instant its first
        step takes (at least one, at most all)."""
        return min(burst, max(1, int(self.burst_share * burst + 0.5)))

    def inbound(self, prompt_tokens: int) -> float:
        """Seconds from the server receiving a request to the engine having it."""
        return self.per_request + self.per_prompt_token * prompt_tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
