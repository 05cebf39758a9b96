"""Load a run directory (DESIGN.md "Run directory") into one in-memory `Run`.

Every analysis command (diagnose, compare, report, the matrix) reads runs through
`load_run`; nothing else in `analyze` or `report` opens these files.

Contract:
- ``requests.jsonl`` must exist and hold at least one record; every other file is optional.
- A truncated last line of a ``.jsonl`` file (a crashed run) is skipped and counted
  in ``Run.skipped_lines``; a malformed line elsewhere is an error naming the line.
- Client records join server timelines by the request id the server reported in
  ``server_timeline.request_id`` when present, else by the client's own id.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from servelab.analyze.summary import summarize
from servelab.engine.config import EngineConfig
from servelab.server.args import parse_size_gb
from servelab.vocab import ClientRecord, RequestTimeline, StepRecord

# `servelab serve` flags whose EngineConfig field has another name or unit.
_FLAG_FIELDS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "kv_cache_memory": ("kv_cache_memory_gb", parse_size_gb),
    "num_gpu_blocks_override": ("num_kv_blocks", int),
}


class RunDirError(ValueError):
    """The path is not a readable run directory; the message says what to do."""


@dataclass
class Run:
    path: Path
    manifest: dict[str, Any]
    records: list[ClientRecord]
    timelines: dict[str, RequestTimeline]
    steps: list[StepRecord]
    metrics: dict[str, Any] | None = None
    scrapes: list[dict[str, Any]] = field(default_factory=list)
    skipped_lines: int = 0
    _summary: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return str(self.manifest.get("name") or self.path.name)

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
    def server(self) -> dict[str, Any]:
        return self.manifest.get("server") or {}

    @property
    def engine_config(self) -> dict[str, Any]:
        """The server's engine settings ({} if unknown).

        A launched servelab server records only the flags it was given; the engine's
        defaults fill in the rest, so "chunked prefill on" is known even when implicit.
        """
        server = self.server
        recorded: dict[str, Any] = {}
        for key in ("engine_config", "config"):
            if isinstance(server.get(key), dict):
                recorded = server[key]
                break
        if self.target_kind != "servelab" or self.simulated:
            return recorded
        recorded = dict(recorded)
        for flag, (name, parse) in _FLAG_FIELDS.items():
            if flag in recorded:
                recorded[name] = parse(str(recorded.pop(flag)))
        return {k: v for k, v in asdict(EngineConfig()).items() if v is not None} | recorded

    @property
    def model(self) -> str | None:
        server = self.server
        return server.get("model") or self.manifest.get("model")

    @property
    def workload(self) -> Any:
        return self.manifest.get("workload")

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

    def summary(self) -> dict[str, Any]:
        """The whole run's ``summarize`` body: metrics.json's when it holds one, else
        computed from the records (a sweep's metrics.json holds per-stage bodies only)."""
        if self._summary is None:
            m = self.metrics or {}
            self._summary = m if "overall" in m else summarize(self.records)
        return self._summary

    def stage_summaries(self) -> dict[str, dict[str, Any]]:
        """label -> ``summarize`` body per sweep stage (empty for a single-load run)."""
        stored = {
            s["label"]: s["metrics"]
            for s in (self.metrics or {}).get("stages", [])
            if s.get("label") is not None and s.get("metrics")
        }
        out = {}
        for stage in self.stages:
            if stage in stored:
                out[stage] = stored[stage]
            else:
                recs = [r for r in self.records if r.stage == stage]
                out[stage] = summarize(recs, n_boot=0)
        return out

    def timeline_for(self, record: ClientRecord) -> RequestTimeline | None:
        server_id = (record.server_timeline or {}).get("request_id")
        if server_id is not None and server_id in self.timelines:
            return self.timelines[server_id]
        return self.timelines.get(record.request_id)


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Rows of a JSONL file, and 1 if its last line was cut off mid-write."""
    if not path.exists():
        return [], 0
    lines = path.read_text(encoding="utf-8").splitlines()
    rows: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                return rows, 1  # a crash mid-append: the earlier lines are whole
            raise RunDirError(
                f"{path}:{i + 1} is not valid JSON ({e}); fix or delete that line"
            ) from e
    return rows, 0


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
    manifest: dict[str, Any] = {}
    if (p / "manifest.json").exists():
        try:
            manifest = json.loads((p / "manifest.json").read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise RunDirError(f"{p / 'manifest.json'} is not valid JSON ({e})") from e
    req_rows, s1 = _read_jsonl(p / "requests.jsonl")
    if not req_rows:
        raise RunDirError(
            f"{p / 'requests.jsonl'} holds no finished request yet: there is nothing to "
            "analyse; wait for the run to finish requests (or rerun it)"
        )
    tl_rows, s2 = _read_jsonl(p / "server.jsonl")
    step_rows, s3 = _read_jsonl(p / "steps.jsonl")
    scrapes, s4 = _read_jsonl(p / "metrics_scrape.jsonl")
    metrics = None
    if (p / "metrics.json").exists():
        try:
            metrics = json.loads((p / "metrics.json").read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            metrics = None  # derived data: recomputed from the records when needed
    timelines = {}
    for row in tl_rows:
        tl = RequestTimeline.from_dict(row)
        timelines[tl.request_id] = tl
    return Run(
        path=p,
        manifest=manifest,
        records=[ClientRecord.from_dict(r) for r in req_rows],
        timelines=timelines,
        steps=sorted((StepRecord.from_dict(s) for s in step_rows), key=lambda s: s.start),
        metrics=metrics,
        scrapes=scrapes,
        skipped_lines=s1 + s2 + s3 + s4,
    )
