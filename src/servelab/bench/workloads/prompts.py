"""Prompt text of an exact token length under a given tokenizer.

Text is assembled from *pieces* of the built-in corpus: a run of whitespace followed by
a run of non-whitespace (``" river"``, ``"\\n\\n    return"``). Byte-level BPE tokenizers
pre-split text at those boundaries, so a piece's token count does not depend on its
neighbours and the count of a text is (nearly always) the sum of its pieces' counts.
Every text is still encoded once in full to check, and corrected at its tail when a
tokenizer merges across a boundary; a text that cannot be made exact is an error.

Segments that are joined (a shared prefix, then a request's own text) end with a
non-space character and start with a space, so the join never changes the tokens of
either side: a shared prefix has the same token ids in every prompt that uses it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from typing import Protocol

from servelab.bench.workloads.corpus import CODE, CODE_TASKS, LEAD_WORDS, PROSE, QUESTIONS

_PIECE = re.compile(r"\s*\S+")
_MAX_FIX = 40
_PUNCT = (",", ";", ":", "!", "?", ".", "-")


class TokenizerLike(Protocol):
    """What the benchmark needs of a tokenizer (``servelab.modelcore.tokenizer.Tokenizer`` fits)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def split_pieces(text: str) -> list[str]:
    """``"a b\\n c"`` -> ``["a", " b", "\\n c"]`` (trailing whitespace is dropped)."""
    return _PIECE.findall(text)


class PromptFactory:
    """Builds texts of exact token lengths from the corpus, for one tokenizer.

    ``segment(n, rng, style, lead)`` returns a text of exactly ``n`` tokens when it is
    appended to any text ending in a non-space character (or used on its own with
    ``at_start=True``). ``wrap`` maps a prompt to the text the server actually tokenizes
    (the chat template for chat requests); exactness is checked on the wrapped text.
    """

    STYLES = ("prose", "code", "question")

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self.tokenizer = tokenizer
        self._counts: dict[str, int] = {}
        self._pools = {
            "prose": [split_pieces(" " + s) for s in PROSE],
            "code": [split_pieces("\n\n" + c) for c in CODE],
            "question": [split_pieces(" " + q) for q in QUESTIONS],
            "code_task": [split_pieces(" " + t) for t in CODE_TASKS],
        }
        every = {p for pool in self._pools.values() for s in pool for p in s}
        self._count_all(sorted(every))
        words = sorted(p for p in self._counts if p.startswith(" ") and not p[1:].isspace())
        self._count_all([w[1:] for w in words])
        # Fillers: words that follow a non-space character, and words that open a prompt.
        self._by_count = _by_count({w: self._counts[w] for w in words})
        self._start_by_count = _by_count({w[1:]: self._counts[w[1:]] for w in words})
        if 1 not in self._by_count:
            # A vocabulary without one-token words (merges across spaces): pad with
            # punctuation; the exactness check corrects any merge with the previous word.
            self._count_all(list(_PUNCT))
            self._by_count[1] = [p for p in _PUNCT if self._counts[p] == 1]
        if not self._by_count.get(1) or 1 not in self._start_by_count:
            raise ValueError(
                "the tokenizer encodes no corpus word as one token; cannot pad prompts"
            )

    # ---------------------------------------------------------------- counting

    def count(self, text: str) -> int:
        """Tokens in ``text`` (no special tokens added)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def _count_all(self, pieces: list[str]) -> None:
        batch = getattr(self.tokenizer, "encode_batch", None)
        todo = [p for p in pieces if p not in self._counts]
        if batch is not None and todo:
            for p, ids in zip(todo, batch(todo)):
                self._counts[p] = len(ids)
        for p in todo:
            if p not in self._counts:
                self._counts[p] = self.count(p)

    def _piece_count(self, piece: str) -> int:
        c = self._counts.get(piece)
        if c is None:
            c = self._counts[piece] = self.count(piece)
        return c

    # ---------------------------------------------------------------- text streams

    def lead(self, word: str, number: int) -> str:
        """A short unique opening such as ``" Ticket 482913."``."""
        return f" {word} {number}."

    def _stream(self, rng: random.Random, style: str) -> Iterator[list[str]]:
        """Endless sentences (as piece lists) in ``style``; paragraphs break every few."""
        if style == "code":
            yield self._pools["code_task"][rng.randrange(len(self._pools["code_task"]))]
            while True:
                yield self._pools["code"][rng.randrange(len(self._pools["code"]))]
        if style == "question":
            yield self._pools["question"][rng.randrange(len(self._pools["question"]))]
        prose = self._pools["prose"]
        until_break = rng.randint(3, 6)
        while True:
            s = prose[rng.randrange(len(prose))]
            until_break -= 1
            if until_break == 0:
                until_break = rng.randint(3, 6)
                s = ["\n\n" + s[0].lstrip(), *s[1:]]
            yield s

    def _fill(
        self, pieces: list[str], total: int, n: int, rng: random.Random, at_start: bool
    ) -> None:
        """Append filler words to bring an estimated count ``total`` up to ``n``."""
        while total < n:
            table = self._start_by_count if at_start and not pieces else self._by_count
            need = n - total
            c = need if need in table else max(k for k in table if k <= need)
            options = table[c]
            pieces.append(options[rng.randrange(len(options))])
            total += c

    def _pieces(
        self, n: int, rng: random.Random, style: str, lead: str | None, at_start: bool
    ) -> list[str]:
        if style not in self.STYLES:
            raise ValueError(f"unknown text style {style!r}; use one of {', '.join(self.STYLES)}")
        pieces: list[str] = []
        total = 0
        sentences: Iterator[list[str]] = self._stream(rng, style)
        if lead:
            sentences = _chain([split_pieces(lead)], sentences)
        for sentence in sentences:
            for p in sentence:
                if at_start and not pieces:
                    p = p.lstrip()
                c = self._piece_count(p)
                if total + c > n:
                    self._fill(pieces, total, n, rng, at_start)
                    return pieces
                pieces.append(p)
                total += c
                if total == n:
                    return pieces
        raise AssertionError("unreachable: the sentence stream is endless")

    # ---------------------------------------------------------------- exact texts

    def segment(
        self,
        n: int,
        rng: random.Random,
        style: str = "prose",
        lead: str | None = None,
        *,
        head: str = "",
        wrap: Callable[[str], str] | None = None,
        target: int | None = None,
    ) -> str:
        """A text of ``n`` tokens to append to ``head``.

        The result is checked by encoding ``wrap(head + text)``, which must have
        ``target`` tokens (default: ``count(wrap(head)) + n``; pass it when known, to save
        an encode). Raises ValueError when no correction makes it exact.
        """
        if n < 1:
            raise ValueError(f"a prompt segment needs at least 1 token, got {n}")
        wrap = wrap or _identity
        at_start = not head
        pieces = self._pieces(n, rng, style, lead, at_start)
        if target is None:
            target = (self.count(wrap(head)) if (head or wrap is not _identity) else 0) + n
        for _ in range(_MAX_FIX):
            text = "".join(pieces)
            got = self.count(wrap(head + text))
            if got == target:
                return text
            if got > target:
                # drop trailing pieces worth at least the excess, then pad back up
                excess = got - target
                while excess > 0 and pieces:
                    excess -= self._piece_count(pieces.pop())
                if excess < 0:
                    self._fill(pieces, 0, -excess, rng, at_start)
            else:
                self._fill(pieces, 0, target - got, rng, at_start)
        raise ValueError(
            f"could not build a prompt of exactly {n} tokens with this tokenizer "
            f"(got {got} after {_MAX_FIX} corrections); try the model's own --tokenizer"
        )

    def fixed_text(
        self,
        n: int,
        seed: int | str,
        style: str = "prose",
        lead: str | None = None,
        *,
        at_start: bool = False,
    ) -> str:
        """A deterministic text of ``n`` tokens for a seed (shared prefixes, trace blocks).

        With ``at_start`` it opens a prompt; otherwise it starts with a space and is
        exact when appended to text that ends in a non-space character.
        """
        rng = random.Random(str(seed))
        if at_start:
            return self.segment(n, rng, style, lead, target=n)
        return self.segment(n, rng, style, lead, head=".", target=self.count(".") + n)


def _by_count(counts: dict[str, int]) -> dict[int, list[str]]:
    table: dict[int, list[str]] = {}
    for piece in sorted(counts):
        table.setdefault(counts[piece], []).append(piece)
    return table


def _identity(text: str) -> str:
    return text


def _chain(first: list[list[str]], rest: Iterator[list[str]]) -> Iterator[list[str]]:
    yield from first
    yield from rest


def lead_number(index: int, salt: int) -> int:
    """A 6-digit number unique for every ``index`` below 900,000 (a scrambled counter)."""
    return 100_000 + (index * 7919 + salt) % 900_000


def lead_word(index: int) -> str:
    return LEAD_WORDS[index % len(LEAD_WORDS)]
