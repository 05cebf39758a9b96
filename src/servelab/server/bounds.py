"""Cheap, exact bounds checked before a request is decoded or tokenised.

- ``json_too_deep``: a body nested deeper than a limit is refused before msgspec recurses
  into it (msgspec would raise RecursionError deep inside the decoder).
- ``longest_token_chars``: the most characters of input one token can stand for. A text of
  C characters needs at least ceil(C / L) tokens, so a prompt whose lower bound already
  exceeds the context is refused without tokenising it (which costs memory and seconds).
"""

from __future__ import annotations

from typing import Any

import numpy as np

_BRACKETS = b"[]{}"
_NON_BRACKETS = bytes(b for b in range(256) if b not in _BRACKETS)
_AS_STEPS = bytes.maketrans(_BRACKETS, b"\x01\xff\x01\xff")  # as int8: +1 opens, -1 closes
_CHUNK = 1 << 20  # bounds the int32 running depths held at once (4 MiB)


def _height_exceeds(data: bytes, max_depth: int) -> bool:
    # The running depth is the cumulative sum of +1/-1 steps, one per bracket: one pass in
    # C whatever the shape (repeatedly deleting "()" pairs cost seconds on "[[[[...").
    steps = np.frombuffer(data.translate(_AS_STEPS, _NON_BRACKETS), dtype=np.int8)
    depth = 0
    for start in range(0, len(steps), _CHUNK):
        running = np.cumsum(steps[start : start + _CHUNK], dtype=np.int32) + depth
        if running.max() > max_depth:
            return True
        depth = int(running[-1])
    return False


def json_too_deep(body: bytes, max_depth: int) -> bool:
    """True if ``body`` nests arrays/objects more than ``max_depth`` levels deep.

    Every step is a C loop over bytes. The common body has few brackets (two ``count``
    calls) or brackets that nest shallowly even counting those inside strings (one
    ``translate`` and a running sum). Only a body that looks deep that way pays for
    cutting its strings out (a split at every quote), so that a prompt full of brackets is
    not refused. Brackets inside strings could also hide depth (``[ "]" [ ... ] "[" ]``);
    msgspec's own recursion limit still turns such a body into a 400 (protocol._decode).
    """
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return False
    if not _height_exceeds(body, max_depth):
        return False
    # Outside strings: drop escaped backslashes, then escaped quotes (both only occur
    # inside strings), and keep every other piece between quotes.
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    return _height_exceeds(b"".join(unescaped.split(b'"')[::2]), max_depth)


def longest_token_chars(tokenizer: Any) -> int | None:
    """The most input characters one token covers, or None when no exact bound is known.

    Byte-level BPE vocabularies spell each input byte as one character and every character
    is at least one byte; SentencePiece-style vocabularies spell each (normalised) input
    character as one character; added tokens match their content literally. In all three,
    a token's string is at least as long as the input it covers. A normaliser could shrink
    the input first (NFC composes two characters into one), so with one the bound is not
    exact and None is returned.
    """
    backend = getattr(tokenizer, "backend", None)
    if backend is None or getattr(backend, "normalizer", None) is not None:
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    return max((len(token) for token in vocab), default=0) or None


def least_tokens(chars: int, longest: int) -> int:
    """The fewest tokens a text of ``chars`` characters can become: ceil(chars / longest)."""
    return -(-chars // longest)
