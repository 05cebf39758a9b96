"""The proposer interface: what a source of draft tokens must do.

A proposer guesses the next tokens of running requests; the target model verifies them in
the next step (``ScheduledSeq.draft_token_ids``), so a bad guess costs time, never
correctness. New kinds (EAGLE-style heads, Medusa) implement this protocol and are passed
to ``LLMEngine(..., proposer=...)`` or added to ``servelab.engine.spec.factory``.

Contract:
- ``propose(batch)`` returns, per request id of ``batch``, at most ``max_tokens`` draft
  tokens (fewer or none is fine: no drafts means an ordinary decode step). It must not
  change ``token_ids``.
- Drafts must be a deterministic function of ``token_ids`` (and the proposer's own state),
  never of the target's random draws: the verifier treats each draft as a point mass, which
  preserves the target distribution exactly for any such proposer.
- For one request id, ``token_ids`` only grows between calls (verified tokens are appended;
  rejected drafts never appear in it). ``remove(request_id)`` forgets a request (finished,
  aborted or preempted) and frees whatever it held; a later call for that id starts afresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class DraftRequest:
    """One request's context for a proposal."""

    request_id: str
    token_ids: list[int]  # prompt + verified output so far (read only)
    max_tokens: int  # propose at most this many drafts (>= 1)


class Proposer(Protocol):
    """A source of draft tokens (see the module contract)."""

    def propose(self, batch: list[DraftRequest]) -> dict[str, list[int]]: ...

    def remove(self, request_id: str) -> None: ...
