"""The run directory: every file a run leaves behind, written and read here and nowhere else.

Layout (format ``FORMAT_VERSION``; ``manifest.json["format_version"]``):

- ``manifest.json``: the command (keys redacted), versions, machine, the server and its
  *resolved* engine config (``server.engine_config``, as the server reported it or the
  simulator ran it), the workload spec, load, SLOs and the measured window; for a run
  made by another tool (``servelab import``), ``imported``: the tool, its version, the
  source file and what it ``lacks`` (``Run.lacks``).
- ``requests.jsonl``: one ``ClientRecord`` per line, appended with a single ``write`` on an
  ``O_APPEND`` descriptor as each request finishes, so a crash or SIGKILL leaves only whole
  lines (the kernel holds what was written even if the process dies).
- ``server.jsonl`` / ``steps.jsonl``: server timelines and engine steps (servelab targets
  and simulated runs).
- ``metrics_scrape.jsonl``: ``{"t", "text"}`` Prometheus scrapes of ``/metrics``.
- ``metrics.json``: the summary (``analyze.summary.summarize``), derived from the records.
- ``server.log``: a launched server's output.
- ``trace.jsonl``: an imported run's sends and lengths as a Mooncake trace, the workload
  its manifest names for the replay (written by ``servelab import``).

Contract:
- ``manifest.json`` and ``metrics.json`` are written whole, atomically (temp file + rename).
- ``RunDir`` refuses to write into a directory that already holds a run's records.
- ``load_run`` needs ``requests.jsonl`` with at least one record; every other file is
  optional. A truncated last line of a ``.jsonl`` file (a crashed run) is skipped and counted
  in ``Run.skipped_lines``; a malformed line elsewhere is an error naming the line.
- Client records join server timelines by the request id the server reported in
  ``server_timeline.request_id`` when present, else by the ``X-Request-Id`` it answered,
  else by the one the client sent, else (runs that sent the plan's id) the client's own id.
- The manifest is kept as read: fields this version does not know survive a
  ``load_run`` → ``RunDir.write_manifest`` round trip.
- Readers take the engine config the manifest recorded and never fill it from today's
  defaults: a run written before ``format_version`` 2 recorded only the flags it was given,
  and that is all ``Run.engine_config`` reports for it.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from servelab.engine_flags import config_settings
from servelab.vocab import ClientRecord, RequestTimeline, StepRecord

FORMAT_VERSION = 2  # 1: no version field, flags-only engine config; 2: resolved config
# What an imported run (``servelab import``) may lack, in ``manifest["imported"]["lacks"]``:
# this one means its records hold the first token's time but not every token's.
LACKS_TOKEN_TIMES = "token_times"

_encoder = msgspec.json.Encoder()
_encode, _encode_lines = _encoder.encode, _encoder.encode_lines
_BATCH = 4096  # lines per write in ``JsonlAppender.write_all``
_JSONL = ("requests.jsonl", "server.jsonl", "steps.jsonl", "metrics_scrape.jsonl")


class RunDirError(ValueError):
    """The path is not a readable run directory; the message says what to do."""


def server_id(record: ClientRecord) -> str:
    """The id a server knows ``record``'s request by (see the join rule above)."""
    reported = (record.server_timeline or {}).get("request_id")
    return str(reported or record.server_request_id or record.sent_request_id or record.request_id)


# --------------------------------------------------------------------------- writing


def record_line(rec: ClientRecord) -> bytes:
    """One JSON line: msgspec reads the dataclass's fields itself (no dict, no ``asdict``
    deep copy of every list), in field order."""
    return _encode(rec) + b"\n"


class JsonlAppender:
    """Appends whole lines to a file: one ``os.write`` per line, or per batch of whole
    lines (``write_all``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.lines = 0

    def write_line(self, line: bytes) -> None:
        self._write(line)
        self.lines += 1

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:  # a regular file takes it in one write; loop only if it does not
            n = os.write(self._fd, view)
            view = view[n:]

    def write(self, obj: Any) -> None:
        self.write_line(_encode(obj) + b"\n")

    def write_all(self, objs: Sequence[Any]) -> None:
        """``write`` of each object, the same bytes, in writes of ``_BATCH`` whole lines: for
        a run written at once (the simulator's), where a write per line cost more than
        encoding it."""
        for i in range(0, len(objs), _BATCH):
            batch = objs[i : i + _BATCH]
            self._write(_encode_lines(batch))
            self.lines += len(batch)

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
        for name in _JSONL:
            (self.path / name).unlink(missing_ok=True)
        self.requests = JsonlAppender(self.path / "requests.jsonl")
        self._server: JsonlAppender | None = None
        self._steps: JsonlAppender | None = None
        self._scrapes: JsonlAppender | None = None

    def add_record(self, rec: ClientRecord) -> None:
        self.requests.write_line(record_line(rec))

    def add_records(self, recs: Sequence[ClientRecord]) -> None:
        """``add_record`` of each, batched (``JsonlAppender.write_all``)."""
        self.requests.write_all(recs)

    def add_timeline(self, timeline: dict[str, Any]) -> None:
        self._server_file().write(timeline)

    def add_timelines(self, timelines: Sequence[dict[str, Any]]) -> None:
        """``add_timeline`` of each, batched (none: no file, as without a call)."""
        if timelines:
            self._server_file().write_all(timelines)

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
        self._steps_file().write(step)

    def add_steps(self, steps: Sequence[dict[str, Any]]) -> None:
        """``add_step`` of each, batched (none: no file, as without a call)."""
        if steps:
            self._steps_file().write_all(steps)

    def _steps_file(self) -> JsonlAppender:
        if self._steps is None:
            self._steps = JsonlAppender(self.path / "steps.jsonl")
        return self._steps

    def add_scrape(self, t: float, text: str) -> None:
        if self._scrapes is None:
            self._scrapes = JsonlAppender(self.path / "metrics_scrape.jsonl")
        self._scrapes.write({"t": t, "text": text})

    def write_json(self, name: str, obj: Any) -> Path:
        """Write ``name`` atomically (pretty-printed JSON)."""
        return write_json(self.path / name, obj)

    def write_manifest(self, manifest: dict[str, Any]) -> Path:
        """Write ``manifest.json`` with this module's ``format_version``."""
        return write_manifest(self.path, manifest)

    @property
    def server_log(self) -> Path:
        return self.path / "server.log"

    def close(self) -> None:
        for w in (self.requests, self._server, self._steps, self._scrapes):
            if w is not None:
                w.close()


def write_json(path: Path, obj: Any) -> Path:
    """Write ``obj`` to ``path`` atomically (pretty-printed JSON)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(msgspec.json.format(_encode(obj), indent=1))
    os.replace(tmp, path)
    return path


def write_manifest(run_dir: str | Path, manifest: dict[str, Any]) -> Path:
    """(Re)write a run's ``manifest.json``, every field kept, stamped with the format."""
    return write_json(
        Path(run_dir) / "manifest.json", {**manifest, "format_version": FORMAT_VERSION}
    )


# --------------------------------------------------------------------------- reading


def read_json(run_dir: str | Path, name: str) -> dict[str, Any] | None:
    """A run's ``manifest.json`` or ``metrics.json`` as written (None if it has none yet)."""
    path = Path(run_dir) / name
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise RunDirError(f"{path} is not valid JSON ({e})") from e


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Rows of a JSONL file (none if it is missing), and 1 if its last line was cut off
    mid-write. A malformed line anywhere else raises RunDirError naming it."""
    if not path.exists():
        return [], 0
    lines = path.read_bytes().split(b"\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    rows: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(msgspec.json.decode(line))
        except msgspec.DecodeError as e:
            if i == last:
                return rows, 1  # a crash mid-append: the earlier lines are whole
            raise RunDirError(
                f"{path}:{i + 1} is not valid JSON ({e}); fix or delete that line"
            ) from e
    return rows, 0


_Row = TypeVar("_Row", ClientRecord, RequestTimeline, StepRecord)


def read_rows(path: Path, cls: type[_Row]) -> tuple[list[_Row], int]:
    """``cls.from_dict`` of each row of a JSONL file, with ``read_jsonl``'s contract (none
    if the file is missing; a cut-off last line skipped and counted; any other malformed
    line an error naming it).

    Each line is decoded straight into ``cls`` as the file is read: no dict per row, and no
    copy of the whole file in memory. A line whose values ``cls``'s types do not admit
    (an older or hand-written file) is read as a dict and goes through ``from_dict``."""
    if not path.exists():
        return [], 0
    decode = msgspec.json.Decoder(cls).decode
    rows: list[_Row] = []
    with path.open("rb") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                rows.append(decode(line))
                continue
            except msgspec.ValidationError:
                try:
                    row = msgspec.json.decode(line)
                except msgspec.DecodeError as e:
                    err = e
                else:
                    rows.append(cls.from_dict(row))
                    continue
            except msgspec.DecodeError as e:
                err = e
            if not any(rest.strip() for rest in f):
                return rows, 1  # a crash mid-append: the earlier lines are whole
            raise RunDirError(
                f"{path}:{i + 1} is not valid JSON ({err}); fix or delete that line"
            ) from err
    return rows, 0


def read_records(path: str | Path) -> list[ClientRecord]:
    """Records of a ``requests.jsonl``; a cut-off last line (a crash mid-write) is skipped."""
    return read_rows(Path(path), ClientRecord)[0]


@dataclass
class Run:
    """One run directory in memory (``load_run``)."""

    path: Path
    manifest: dict[str, Any]
    records: list[ClientRecord]
    timelines: dict[str, RequestTimeline]
    steps: list[StepRecord]
    metrics: dict[str, Any] | None = None
    scrapes: list[dict[str, Any]] = field(default_factory=list)
    skipped_lines: int = 0
    # What the layers above derive from this run and keep for its lifetime (never written).
    derived: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        return str(self.manifest.get("name") or self.path.name)

    @property
    def format_version(self) -> int:
        return int(self.manifest.get("format_version") or 1)

    @property
    def target_kind(self) -> str:
        """ "servelab" (exact server timelines) or "other" (any other endpoint)."""
        kind = self.manifest.get("target_kind")
        if kind:
            return str(kind)
        return "servelab" if self.timelines else "other"

    @property
    def simulated(self) -> bool:
        return bool(self.manifest.get("simulated", False))

    @property
    def valid(self) -> bool:
        return self.manifest.get("valid", True) is not False

    @property
    def invalid_reason(self) -> str | None:
        return self.manifest.get("invalid_reason")

    @property
    def lacks(self) -> list[str]:
        """What the tool an imported run came from did not record (``LACKS_TOKEN_TIMES``,
        ...); empty for a run servelab recorded itself."""
        return list((self.manifest.get("imported") or {}).get("lacks") or [])

    @property
    def server(self) -> dict[str, Any]:
        return self.manifest.get("server") or {}

    @property
    def engine_config(self) -> dict[str, Any]:
        """The server's engine settings as the manifest recorded them ({} if unknown).

        ``server.engine_config`` is the resolved config (format 2). An older run recorded
        only the flags it launched its server with (``server.config``); those come back under
        their config field names, and unset ones stay unknown rather than taking today's
        defaults.
        """
        server = self.server
        if isinstance(server.get("engine_config"), dict):
            return dict(server["engine_config"])
        flags = server.get("config")
        if not isinstance(flags, dict):
            return {}
        return config_settings(flags)

    @property
    def model(self) -> str | None:
        server = self.server
        return server.get("model") or self.manifest.get("model")

    @property
    def workload(self) -> Any:
        return self.manifest.get("workload")

    @property
    def load(self) -> dict[str, Any]:
        """The load the client ran (the manifest's ``config.load``, a simulated run's
        ``load``); empty where neither is recorded."""
        load = (self.manifest.get("config") or {}).get("load") or self.manifest.get("load")
        return load if isinstance(load, dict) else {}

    @property
    def window(self) -> tuple[float, float]:
        """The measured window (monotonic seconds); derived from the records if absent."""
        w = self.manifest.get("window") or {}
        if w.get("start") is not None and w.get("end") is not None:
            return float(w["start"]), float(w["end"])
        starts = [r.actual_send for r in self.records]
        ends = [r.done for r in self.records if r.done is not None]
        if not starts:
            return 0.0, 0.0
        return min(starts), max(ends or starts)

    @property
    def stages(self) -> list[str]:
        """Sweep stage labels in the order they first appear (empty for a single-load run)."""
        seen: dict[str, None] = {}
        for r in self.records:
            if r.stage is not None:
                seen.setdefault(r.stage, None)
        return list(seen)

    @property
    def classes(self) -> list[str]:
        return sorted({r.workload_class for r in self.records})

    def timeline_for(self, record: ClientRecord) -> RequestTimeline | None:
        found = self.timelines.get(server_id(record))
        return found if found is not None else self.timelines.get(record.request_id)


def load_run(path: str | Path) -> Run:
    """Read the run directory at ``path``. Raises RunDirError with a fix on bad input."""
    p = Path(path)
    if not p.is_dir():
        raise RunDirError(
            f"no run directory at {p}: pass a directory written by `servelab bench` "
            "(it holds manifest.json and requests.jsonl)"
        )
    if not (p / "requests.jsonl").exists():
        raise RunDirError(
            f"{p} has no requests.jsonl, so it is not a benchmark run directory; "
            "pass the directory that `servelab bench` printed at the end of its run"
        )
    manifest = read_json(p, "manifest.json") or {}
    # Reading a run builds millions of objects that all live as long as the Run: the cyclic
    # collector, run as they pile up, would rescan the growing heap again and again (half
    # the time of loading a 200k-request run) and find no garbage.
    collecting = gc.isenabled()
    gc.disable()
    try:
        records, s1 = read_rows(p / "requests.jsonl", ClientRecord)
        if not records:
            raise RunDirError(
                f"{p / 'requests.jsonl'} holds no finished request yet: there is nothing to "
                "analyse; wait for the run to finish requests (or rerun it)"
            )
        tl_rows, s2 = read_rows(p / "server.jsonl", RequestTimeline)
        steps, s3 = read_rows(p / "steps.jsonl", StepRecord)
        scrapes, s4 = read_jsonl(p / "metrics_scrape.jsonl")
    finally:
        if collecting:
            gc.enable()
    metrics = None
    if (p / "metrics.json").exists():
        try:
            metrics = json.loads((p / "metrics.json").read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            metrics = None  # derived data: recomputed from the records when needed
    timelines = {tl.request_id: tl for tl in tl_rows}
    return Run(
        path=p,
        manifest=manifest,
        records=records,
        timelines=timelines,
        steps=sorted(steps, key=lambda s: s.start),
        metrics=metrics,
        scrapes=scrapes,
        skipped_lines=s1 + s2 + s3 + s4,
    )
