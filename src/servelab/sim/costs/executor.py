"""The simulator's executor: a cost model behind the engine's ``Executor`` protocol.

The engine (its own scheduler and KV cache, unchanged) hands a :class:`BatchPlan` to
:meth:`SimExecutor.execute`; the executor predicts the step time, advances the
virtual clock the engine reads its timestamps from, and returns placeholder tokens.
:class:`PacedExecutor` sleeps for the predicted time instead, for real-time serving.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Protocol

from servelab.engine.batch_plan import BatchPlan, StepOutput
from servelab.sim.costs.serving_path import ServingPath
from servelab.sim.costs.work import StepWork, work_of_plan


class CostModel(Protocol):
    """Predicts the duration (seconds) of one engine step from its work."""

    @property
    def name(self) -> str: ...

    def predict(self, w: StepWork) -> float: ...

    def decode_time(self, num_seqs: int, context_tokens: int) -> float:
        """``predict(decode_work(num_seqs, context_tokens))``, as fast as the model can."""
        ...

    def describe(self) -> dict: ...


class VirtualClock:
    """A clock the simulator owns: ``clock()`` reads it, only the simulation moves it."""

    __slots__ = ("now",)

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        self.now += dt

    def advance_to(self, t: float) -> None:
        """Jump forward to ``t`` (an idle engine waiting for the next arrival); never back."""
        self.now = max(self.now, t)


class SimExecutor:
    """Executes plans in virtual time.

    Contract: ``execute`` advances ``clock`` by exactly the predicted step time and
    returns it as ``elapsed``; every sampled sequence gets one placeholder token per
    accepted position (drafts are accepted with ``spec_acceptance`` each, in order,
    from a seeded generator). Placeholders cycle through ``placeholder_ids`` and are
    never an EOS id, so requests end by ``max_tokens``. Request ids in ``imported``
    had their prompt KV transferred in (disaggregated decode) and pay no prefill.
    With ``step_noise`` (a :class:`~servelab.sim.costs.noise.NoiseSampler`), each step's
    predicted time is multiplied by its next factor. ``serving_path`` is the server around
    this engine (:class:`~servelab.sim.costs.serving_path.ServingPath`; None: none), which
    the simulation loop applies to the requests and chunks of this replica.
    """

    def __init__(
        self,
        cost_model: CostModel,
        clock: VirtualClock,
        max_model_len: int,
        kv_bytes_per_token: float,
        eos_token_ids: list[int] | None = None,
        placeholder_ids: list[int] | None = None,
        spec_acceptance: float = 0.7,
        seed: int = 0,
        step_noise: Callable[[], float] | None = None,
        serving_path: ServingPath | None = None,
    ) -> None:
        self.cost_model = cost_model
        self.serving_path = serving_path
        self.step_noise = step_noise
        self.clock = clock
        self.max_model_len = max_model_len
        self.eos_token_ids = list(eos_token_ids or [])
        ids = [t for t in (placeholder_ids or [0]) if t not in self.eos_token_ids]
        if not ids:
            raise ValueError("placeholder_ids must contain a token that is not an EOS id")
        self._placeholders = ids
        self._kv_bytes_per_token = kv_bytes_per_token
        self._spec_acceptance = spec_acceptance
        self._rng = random.Random(seed)
        self.imported: set[str] = set()
        self.num_blocks = 0
        self.busy_time = 0.0
        self.steps = 0

    def kv_block_bytes(self, block_size: int) -> int:
        return int(self._kv_bytes_per_token * block_size)

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks

    def predict(self, plan: BatchPlan) -> float:
        return self._time(work_of_plan(plan, self.imported))

    def _time(self, w: StepWork) -> float:
        return self._noisy(self.cost_model.predict(w))

    def _noisy(self, dt: float) -> float:
        return dt if self.step_noise is None else dt * self.step_noise()

    def _run(self, dt: float) -> None:
        self.clock.now += dt  # ``clock.advance``, a call less on every step
        self.busy_time += dt
        self.steps += 1

    def _sample(self, plan: BatchPlan) -> dict[str, list[int]]:
        ph = self._placeholders
        nph = len(ph)
        sampled: dict[str, list[int]] = {}
        for s in plan.seqs:
            if not s.sample:
                continue
            tok = ph[s.num_output_tokens % nph]
            if s.draft_token_ids:
                accepted = 0
                while (
                    accepted < len(s.draft_token_ids) and self._rng.random() < self._spec_acceptance
                ):
                    accepted += 1
                sampled[s.request_id] = list(s.draft_token_ids[:accepted]) + [tok]
            else:
                sampled[s.request_id] = [tok]
        return sampled

    def execute(self, plan: BatchPlan) -> StepOutput:
        dt = self.predict(plan)
        self._run(dt)
        return StepOutput(sampled=self._sample(plan), elapsed=dt)

    # The engine's decode bursts (``LLMEngine.decode_burst``): the same steps without plans.

    def execute_decodes(self, num_seqs: int, context_tokens: int) -> float:
        """Run one step of ``num_seqs`` one-token decodes after ``context_tokens`` cached tokens
        in all, exactly as :meth:`execute` runs that plan (time, clock, counters, noise draw);
        the tokens are :meth:`decode_tokens`'. Imported prompts change nothing for a decode."""
        dt = self.cost_model.decode_time(num_seqs, context_tokens)
        if self.step_noise is not None:  # ``_noisy``, a call less on most steps of a replay
            dt *= self.step_noise()
        self._run(dt)
        return dt

    def decode_tokens(self, num_output_tokens: int, count: int) -> list[int]:
        """The tokens :meth:`execute` samples for a sequence over its next ``count`` decodes,
        from ``num_output_tokens`` output tokens on (never an EOS id)."""
        ph = self._placeholders
        if len(ph) == 1:
            return ph * count
        nph = len(ph)
        return [ph[i % nph] for i in range(num_output_tokens, num_output_tokens + count)]

    def forget(self, request_id: str) -> None:
        """Drop per-request state once the request is finished."""
        self.imported.discard(request_id)


class PacedExecutor(SimExecutor):
    """A :class:`SimExecutor` on the wall clock: each step sleeps its predicted time.

    The engine around it uses ``time.monotonic`` as usual, so a server running it
    answers with the simulated hardware's timing (plus the engine's own overhead).
    """

    def __init__(self, cost_model: CostModel, **kwargs) -> None:
        super().__init__(cost_model, VirtualClock(), **kwargs)

    def execute(self, plan: BatchPlan) -> StepOutput:
        t0 = time.monotonic()
        dt = self.predict(plan)
        sampled = self._sample(plan)
        remaining = dt - (time.monotonic() - t0)
        if remaining > 0:
            time.sleep(remaining)
        self.busy_time += dt
        self.steps += 1
        return StepOutput(sampled=sampled, elapsed=dt)
