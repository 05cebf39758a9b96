"""Whether a server's ``usage.completion_tokens`` can be what it streamed (docs/metrics.md).

A server's own count is preferred to the client's re-count (it knows its tokenizer), unless
it cannot be true of the stream the client received:

- each token-bearing chunk carries at least one token, and at most ``MAX_TOKENS_PER_CHUNK``
  (speculative decoding sends a step's accepted draft tokens plus one in a chunk; servers
  that batch their stream send a few steps' tokens); and, where the client re-counted the
  text it received,
- the claim lies within a factor ``RECOUNT_FACTOR`` of that re-count (a re-count under
  another model's tokenizer differs from the server's by far less).

Both bounds allow ``SLACK`` tokens either way (special tokens that stream no text, a last
partial chunk). A claim outside them is *disputed*: the record keeps it in
``disputed_usage`` and counts the client's figure instead.
"""

from __future__ import annotations

MAX_TOKENS_PER_CHUNK = 16
RECOUNT_FACTOR = 4.0
SLACK = 8


def usage_plausible(claimed: int, chunks: int | None, recount: int | None) -> bool:
    """``claimed`` output tokens against ``chunks`` token-bearing stream chunks (None: not
    streamed) and the client's ``recount`` of the text (None: no tokenizer)."""
    if (
        chunks is not None
        and not chunks - SLACK <= claimed <= chunks * MAX_TOKENS_PER_CHUNK + SLACK
    ):
        return False
    if recount is not None:
        return recount / RECOUNT_FACTOR - SLACK <= claimed <= recount * RECOUNT_FACTOR + SLACK
    return True
