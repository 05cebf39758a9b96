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
    output processor and the step lag of asynchronous scheduling). ``source`` says where
    the values come from.
    """

    per_request: float = 0.0
    per_prompt_token: float = 0.0
    output_steps: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        if min(self.per_request, self.per_prompt_token, self.output_steps) < 0:
            raise ValueError("serving-path delays must be >= 0")

    def inbound(self, prompt_tokens: int) -> float:
        """Seconds from the server receiving a request to the engine having it."""
        return self.per_request + self.per_prompt_token * prompt_tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
