"""Incremental detokenization with stop strings.

Contract:
- ``add(token_id, check_stop)`` appends one output token's text. With ``check_stop`` it looks
  for a stop string that ends inside the new text; on a match the text is cut just before
  the stop string and ``add`` returns True (the request is finished; the stop string is not
  part of the output, OpenAI's behaviour).
- ``take(final)`` returns the text not yet returned. While unfinished it holds back a tail
  that could be the start of a stop string, so no client ever sees part of a stop string;
  ``final=True`` flushes everything.
- Text is decoded with a few prompt tokens as left context, so a token's leading space or a
  multi-byte character split across tokens comes out right: a piece that ends in an
  incomplete UTF-8 sequence (U+FFFD) waits for the next token.
"""

from __future__ import annotations

from typing import Protocol

_CONTEXT_TOKENS = 6  # prompt tokens kept as decoding context


class TextTokenizer(Protocol):
    """What the engine needs of a tokenizer (``servelab.modelcore.tokenizer.Tokenizer`` is one)."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class Detokenizer:
    """Turns one request's output tokens into text, step by step."""

    def __init__(self, tokenizer: TextTokenizer, prompt_token_ids: list[int], stop: list[str]):
        self._tok = tokenizer
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the decoding window
        self._read_offset = len(self._ids)  # tokens before this are already in self.text
        self._stop = [s for s in stop if s]
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self.text = ""  # the output text so far (cut before a stop string once found)
        self._sent = 0  # characters of self.text already returned by take()

    def add(self, token_id: int, check_stop: bool) -> bool:
        """Append one token; True if a stop string completed (see the module contract)."""
        self._ids.append(token_id)
        window = self._ids[self._prefix_offset :]
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tok.decode(window)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # no complete character yet
        old_len = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if not (check_stop and self._stop):
            return False
        # Only matches that end in the new piece: earlier ones were seen (or skipped before
        # min_tokens) already.
        found = (self.text.find(s, max(0, old_len - len(s) + 1)) for s in self._stop)
        hits = [i for i in found if i != -1]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def take(self, final: bool) -> str:
        """The text not yet returned, minus a possible stop-string start unless ``final``."""
        end = len(self.text) if final else len(self.text) - self._held_back()
        if end <= self._sent:
            return ""
        piece = self.text[self._sent : end]
        self._sent = end
        return piece

    def _held_back(self) -> int:
        unsent = len(self.text) - self._sent
        for k in range(min(self._max_stop - 1, unsent), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0
