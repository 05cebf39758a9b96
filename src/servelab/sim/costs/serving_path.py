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

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

# Bursts whose prompts' mean length is within this factor of the nearest's count as alike.
ALIKE = 1.5


@dataclass(frozen=True)
class ServingPath:
    """``per_request`` seconds and ``per_prompt_token`` seconds per prompt token between a
    request reaching the server and reaching the engine (HTTP, tokenisation, the hand-over
    to the core): the scheduler sees it that much later. ``output_steps``: each streamed
    chunk reaches the client that many of its step's durations after the step ends (the
    output processor and the step lag of asynchronous scheduling). ``first_steps``: of the
    requests reaching an idle engine at one instant, the share the server has handed to the
    engine when its first step starts, as ``(mean prompt tokens, share)`` of measured
    bursts; the rest join the next step (the front end takes a burst one request at a time
    while the engine starts on the first: ``sim.fit.first_step``). Empty: all at once.
    ``source`` says where the values come from.
    """

    per_request: float = 0.0
    per_prompt_token: float = 0.0
    output_steps: float = 0.0
    first_steps: tuple[tuple[float, float], ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        if min(self.per_request, self.per_prompt_token, self.output_steps) < 0:
            raise ValueError("serving-path delays must be >= 0")
        if any(not (tokens > 0 and 0 < share <= 1) for tokens, share in self.first_steps):
            raise ValueError("a first step's prompt length must be > 0 and its share in (0, 1]")

    def share_for(self, prompt_tokens: float) -> float:
        """The share of a burst of prompts of this mean length that the first step takes:
        the median share of the measured bursts nearest in length (within ``ALIKE`` of the
        nearest); 1 where none was measured."""
        if not self.first_steps:
            return 1.0
        at = math.log(max(prompt_tokens, 1.0))
        off = [abs(math.log(tokens) - at) for tokens, _ in self.first_steps]
        near = min(off) + math.log(ALIKE)
        return statistics.median(
            s for (_, s), d in zip(self.first_steps, off, strict=True) if d <= near
        )

    def first_step(self, burst: int, prompt_tokens: float, slots: int | None = None) -> int:
        """How many of ``burst`` requests of ``prompt_tokens`` mean prompt tokens, reaching an
        idle engine at one instant, its first step takes: ``share_for`` of the burst, or of
        ``slots`` where the engine holds fewer sequences (at least one, at most all)."""
        room = min(burst, slots) if slots else burst
        return min(burst, max(1, int(self.share_for(prompt_tokens) * room + 0.5)))

    def inbound(self, prompt_tokens: int) -> float:
        """Seconds from the server receiving a request to the engine having it."""
        return self.per_request + self.per_prompt_token * prompt_tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
