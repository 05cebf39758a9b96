"""Speculative decoding: proposers guess tokens, the target verifies them in one step.

- ``config``: ``SpeculativeConfig`` (the ``--speculative-config`` JSON), pure Python.
- ``proposer``: the ``Proposer`` protocol every draft source implements.
- ``ngram``: prompt lookup; ``draft_model``: a draft model or the target's first layers.
- ``policy``: per-request draft lengths that back off when drafts keep failing.
- ``decoder``: the engine's side (drafts into requests, outcomes back to the policy).
- ``factory``: builds the decoder and proposer for an engine.

Verification itself is the model runner's (``servelab.model.sampler``); the scheduler
budgets and books the drafts, and the KV cache's ``trim`` frees the blocks that hold only
rejected ones (docs/design/spec_decode.md).
"""
