"""How many drafts to ask for, per request: back off when proposals keep failing.

Drafts cost time (more query rows in the verification step, and for a draft model its
own forwards), so a request whose proposals are rejected should ask for fewer, and one whose
proposals keep failing outright should stop asking for a while. Per request:

- every draft accepted: the length doubles (up to ``num_speculative_tokens``);
- some accepted: the next length is one more than the number accepted;
- none accepted: the length drops to 1, and after the second such proposal in a row the
  request skips proposing for 2, 4, 8 ... (at most ``MAX_SKIP_STEPS``) steps; any
  accepted draft resets that.

A proposal that found nothing (an n-gram miss) changes nothing: it cost nothing.
With ``adaptive`` off every request asks for ``num_speculative_tokens`` every step.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_SKIP_STEPS = 16


@dataclass
class _State:
    length: int
    misses: int = 0  # proposals in a row with nothing accepted
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
        elif accepted:
            st.length = min(self.k, accepted + 1)
            st.misses = 0
        else:
            st.length = 1
            st.misses += 1
            if st.misses >= 2:
                st.skip = min(MAX_SKIP_STEPS, 2 ** (st.misses - 1))

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)
