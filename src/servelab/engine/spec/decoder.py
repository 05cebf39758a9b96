"""The engine's side of speculative decoding: who proposes, how many drafts, what was learnt.

Each step, before scheduling, ``propose`` asks the proposer for drafts for every running
request in its decode phase and stores them in ``Request.spec_token_ids``; the scheduler
then schedules ``1 + len(drafts)`` tokens (fewer drafts if the budget or KV blocks are
short), the executor verifies them, and ``Scheduler.update_from_output`` keeps the accepted
ones. ``observe`` feeds the outcome back to the per-request draft-length policy.

A request's draft count is also capped so that verification never goes past what the
request may produce: its remaining ``max_tokens`` and the context (the bonus token must fit
too), and, while EOS/stop ids are banned (before ``min_tokens``), the tokens still under
that ban: the executor bans them at every row of a step, which is only right for rows
below ``min_tokens``.
"""

from __future__ import annotations

import logging

from servelab.engine.request import Request
from servelab.engine.spec.policy import DraftLengthPolicy
from servelab.engine.spec.proposer import DraftRequest, Proposer
from servelab.vocab import Phase

log = logging.getLogger(__name__)


def draft_limit(req: Request, max_model_len: int) -> int:
    """Most drafts ``req`` may verify in its next step (see the module docstring)."""
    sp = req.sampling_params
    n_out = req.num_output_tokens
    limit = min(sp.max_tokens - n_out, max_model_len - req.num_tokens) - 1
    if req.banned_token_ids():
        limit = min(limit, sp.min_tokens - n_out - 1)
    return max(0, limit)


class SpeculativeDecoder:
    """Drafts for the decoding requests of each step (see the module docstring)."""

    def __init__(self, proposer: Proposer, policy: DraftLengthPolicy, max_model_len: int):
        self.proposer = proposer
        self.policy = policy
        self.max_model_len = max_model_len

    def propose(self, running: list[Request]) -> None:
        """Set ``spec_token_ids`` of every request in ``running`` (empty when none)."""
        batch: list[DraftRequest] = []
        for req in running:
            req.spec_token_ids = []
            if req.phase is not Phase.DECODE:
                continue
            n = min(self.policy.next_length(req.request_id), draft_limit(req, self.max_model_len))
            if n > 0:
                batch.append(DraftRequest(req.request_id, req.token_ids, n))
        if not batch:
            return
        try:
            drafts = self.proposer.propose(batch)
        except (
            Exception
        ):  # speculation is an optimisation: a failing proposer must not fail requests
            log.exception("the draft proposer failed; this step decodes without drafts")
            return
        by_id = {req.request_id: req for req in running}
        for r in batch:
            by_id[r.request_id].spec_token_ids = list(drafts.get(r.request_id, []))[: r.max_tokens]

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        self.policy.observe(request_id, proposed, accepted)

    def preempted(self, request_id: str) -> None:
        """The request lost its KV cache: the proposer's state for it goes too."""
        self.proposer.remove(request_id)

    def finished(self, request_id: str) -> None:
        self.proposer.remove(request_id)
        self.policy.remove(request_id)
