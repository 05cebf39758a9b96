"""Planted engine steps for the test server: one step loop serves every stream at once.

With ``Schedule.steps`` set (the fields of :class:`StepPlan`), the test server stops timing
each stream on its own and runs one loop of steps, as an engine does: each step decodes one
token for every running request and prefills the waiting ones (whole, or in chunks of the
token budget less the step's decodes), admitting requests first come first served up to
``max_seqs``; it lasts ``base + per_decode * decodes + per_prefill_token * prefill tokens``
seconds, and at its end every request it sampled gets its token. ``steps`` keeps what ran
(start, end, decoding ids, prefill tokens per id, the ids given a token): the truth that
step inference from the client's timestamps (``analyze.server_side.stepinfer``) must recover.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepPlan:
    """A step's cost and the scheduler's limits (``budget`` 0: prompts are never chunked)."""

    base: float = 0.02
    per_decode: float = 0.002
    per_prefill_token: float = 0.0001
    budget: int = 0
    max_seqs: int = 64

    def duration(self, decodes: int, prefill_tokens: int) -> float:
        return self.base + self.per_decode * decodes + self.per_prefill_token * prefill_tokens


@dataclass
class _Seq:
    rid: str
    prompt: int
    tokens: int
    queue: asyncio.Queue[float]
    computed: int = 0  # prompt tokens prefilled
    emitted: int = 0


@dataclass
class StepLoop:
    """The loop of :class:`StepPlan` steps on the server's event loop (module doc)."""

    plan: StepPlan
    steps: list[dict[str, Any]] = field(default_factory=list)
    _waiting: list[_Seq] = field(default_factory=list)
    _running: list[_Seq] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    def join(self, rid: str, prompt_tokens: int, tokens: int) -> asyncio.Queue[float]:
        """Queue a request of ``prompt_tokens`` wanting ``tokens`` tokens; each token's step
        end is put on the returned queue when that step ends."""
        q: asyncio.Queue[float] = asyncio.Queue()
        self._waiting.append(_Seq(rid, max(1, prompt_tokens), tokens, q))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        return q

    async def _run(self) -> None:
        while self._waiting or self._running:
            plan = self.plan
            budget = plan.budget or None
            decode = [s for s in self._running if s.computed >= s.prompt]
            used = len(decode)
            prefill: dict[str, int] = {}
            for s in self._running:  # running prefills first, then admissions
                if s.computed < s.prompt:
                    n = s.prompt - s.computed
                    n = n if budget is None else min(n, max(0, budget - used))
                    if n > 0:
                        prefill[s.rid] = n
                        used += n
            while self._waiting and len(self._running) < plan.max_seqs:
                if budget is not None and used >= budget:
                    break
                s = self._waiting.pop(0)
                self._running.append(s)
                n = s.prompt if budget is None else min(s.prompt, budget - used)
                prefill[s.rid] = n
                used += n
            start = time.monotonic()
            await asyncio.sleep(plan.duration(len(decode), sum(prefill.values())))
            end = time.monotonic()
            sampled = []
            for s in list(self._running):
                gets = s in decode
                if s.rid in prefill:
                    s.computed += prefill[s.rid]
                    gets = s.computed >= s.prompt
                if gets:
                    sampled.append(s.rid)
                    s.emitted += 1
                    s.queue.put_nowait(end)
                    if s.emitted >= s.tokens:
                        self._running.remove(s)
            self.steps.append(
                {
                    "start": start,
                    "end": end,
                    "decode": [s.rid for s in decode],
                    "prefill": dict(prefill),
                    "sampled": sampled,
                }
            )
