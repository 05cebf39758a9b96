"""The run directory a benchmark leaves behind (DESIGN.md "Run directory").

- ``requests.jsonl``: one ``ClientRecord`` per line, appended with a single ``write``
  on an ``O_APPEND`` descriptor as each request finishes, so a crash or SIGKILL leaves
  only whole lines (the kernel holds what was written even if the process dies).
- ``server.jsonl`` / ``steps.jsonl``: server timelines and engine steps (servelab targets).
- ``metrics_scrape.jsonl``: ``{"t", "text"}`` Prometheus scrapes of ``/metrics``.
- ``manifest.json`` and ``metrics.json``: written whole, atomically (temp file + rename).
- ``server.log``: the launched server's output.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

from servelab.vocab import ClientRecord

_encode = msgspec.json.Encoder().encode


def record_line(rec: ClientRecord) -> bytes:
    """One JSON line: msgspec reads the dataclass's fields itself (no dict, no ``asdict``
    deep copy of every list), in field order."""
    return _encode(rec) + b"\n"


class JsonlAppender:
    """Appends whole lines to a file with one ``os.write`` each."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.lines = 0

    def write_line(self, line: bytes) -> None:
        view = memoryview(line)
        while view:  # a regular file takes it in one write; loop only if it does not
            n = os.write(self._fd, view)
            view = view[n:]
        self.lines += 1

    def write(self, obj: Any) -> None:
        self.write_line(_encode(obj) + b"\n")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class RunDir:
    """Writers for one run directory. Creating it refuses to mix two runs' records."""

    def __init__(self, path: str | Path, overwrite: bool = False) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        if (self.path / "requests.jsonl").exists() and not overwrite:
            raise ValueError(
                f"{self.path} already holds a run (requests.jsonl); choose another --out "
                "or delete it"
            )
        for name in ("requests.jsonl", "server.jsonl", "steps.jsonl", "metrics_scrape.jsonl"):
            (self.path / name).unlink(missing_ok=True)
        self.requests = JsonlAppender(self.path / "requests.jsonl")
        self._server: JsonlAppender | None = None
        self._steps: JsonlAppender | None = None
        self._scrapes: JsonlAppender | None = None

    def add_record(self, rec: ClientRecord) -> None:
        self.requests.write_line(record_line(rec))

    def add_timeline(self, timeline: dict[str, Any]) -> None:
        self._server_file().write(timeline)

    def add_timeline_json(self, raw: bytes | msgspec.Raw) -> None:
        """A timeline already in JSON (as a server sent it), kept to one line."""
        line = bytes(raw)
        if b"\n" in line:
            line = _encode(msgspec.json.decode(line))
        self._server_file().write_line(line + b"\n")

    def _server_file(self) -> JsonlAppender:
        if self._server is None:
            self._server = JsonlAppender(self.path / "server.jsonl")
        return self._server

    def add_step(self, step: dict[str, Any]) -> None:
        if self._steps is None:
            self._steps = JsonlAppender(self.path / "steps.jsonl")
        self._steps.write(step)

    def add_scrape(self, t: float, text: str) -> None:
        if self._scrapes is None:
            self._scrapes = JsonlAppender(self.path / "metrics_scrape.jsonl")
        self._scrapes.write({"t": t, "text": text})

    def write_json(self, name: str, obj: Any) -> Path:
        """Write ``name`` atomically (pretty-printed JSON)."""
        final = self.path / name
        tmp = final.with_suffix(final.suffix + ".tmp")
        tmp.write_bytes(msgspec.json.format(_encode(obj), indent=1))
        os.replace(tmp, final)
        return final

    @property
    def server_log(self) -> Path:
        return self.path / "server.log"

    def close(self) -> None:
        for w in (self.requests, self._server, self._steps, self._scrapes):
            if w is not None:
                w.close()


def read_records(path: str | Path) -> list[ClientRecord]:
    """Records of a ``requests.jsonl``; a cut-off last line (a crash mid-write) is skipped."""
    lines = Path(path).read_bytes().split(b"\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(ClientRecord.from_dict(msgspec.json.decode(line)))
        except msgspec.DecodeError:
            if i >= len(lines) - 2:
                break
            raise ValueError(f"{path}:{i + 1} is not a JSON record") from None
    return out
