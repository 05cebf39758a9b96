"""How many drafts to ask for, per request: back off when proposals keep failing.

Drafts cost time: more query rows in the verification step, and for a draft model its own
forwards. On a CPU the first extra row is the expensive one (a one-row product runs as a
matrix-vector kernel, two or more rows as a matrix-matrix kernel at a fraction of the
bandwidth), so a verification step with drafts costs about two plain decode steps at batch
1 (docs/design/spec_decode.md): a proposal pays only when at least ``PAYING_ACCEPTED``
drafts are accepted. Per request:

- every draft accepted: the length doubles (up to ``num_speculative_tokens``);
- at least ``PAYING_ACCEPTED`` accepted: the next length is one more than the number
  accepted;
- fewer (a failed proposal): the length drops to one more than the number accepted, and
  the request skips proposing for 1, 4, 16 ... (at most ``MAX_SKIP_STEPS``) steps as such
  failures follow each other; a proposal that pays resets that.

A proposal that found nothing (an n-gram miss) changes nothing: it cost nothing.
With ``adaptive`` off every request asks for ``num_speculative_tokens`` every step.
"""

from __future__ import annotations

from dataclasses import dataclass

PAYING_ACCEPTED = 2
MAX_SKIP_STEPS = 64


@dataclass
class _State:
    length: int
    misses: int = 0  # failed proposals in a row
    skip: int = 0  # steps left without proposing


class DraftLengthPolicy:
    """Per-request draft lengths (see the module docstring)."""

    def __init__(self, num_speculative_tokens: int, adaptive: bool = True) -> None:
        self.k = num_speculative_tokens
        self.adaptive = adaptive
        self._states: dict[str, _State] = {}

    def next_length(self, request_id: str) -> int:
        """Drafts to ask for this step (0: skip). Call once per request per step."""
        if not self.adaptive:
            return self.k
        st = self._states.setdefault(request_id, _State(self.k))
        if st.skip:
            st.skip -= 1
            return 0
        return st.length

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        """The outcome of a verified proposal of ``proposed`` > 0 drafts."""
        st = self._states.get(request_id)
        if st is None:
            return
        if accepted == proposed:
            st.length = min(self.k, 2 * st.length)
            st.misses = 0
            return
        st.length = min(self.k, accepted + 1)
        if accepted >= PAYING_ACCEPTED:
            st.misses = 0
        else:
            st.misses += 1
            st.skip = min(MAX_SKIP_STEPS, 4 ** (st.misses - 1))

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)
