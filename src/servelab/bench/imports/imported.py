"""What a format reader gives back (``Imported``), and the one way it becomes a run directory.

A reader turns another tool's per-request results into ``ClientRecord``s (started with
``ClientRecord.for_request``, as every client starts its records) and says what the format
does not carry (``lacks``, from ``LACKS``). ``write_imported`` writes them with the
benchmark's own writer (``rundir.RunDir``), the summary of ``analyze.summary.summarize`` as
``metrics.json``, and a manifest whose ``imported`` entry names the tool, its version, the
source file (name and SHA-256), what it lacks and the reader's notes, so every later command
can say what an imported run cannot show.

For ``tune`` (and ``sim``'s as-run replay), which rebuild a run's requests through the
benchmark's planner, the writer also leaves the run's sends and lengths as a trace
(``trace.jsonl``, Mooncake JSONL: milliseconds from the first send, input and requested
output tokens), records that trace as the workload and the tool's closed loop (its
streams) or open loop (the trace's times) as the load, and names each record by the
trace row the planner builds from it. The planner's prompts are synthetic text of the
same lengths: what the tool sent is not in its results.

Times stay on the tool's own clock (``Imported.clock``, in the manifest): durations are all
a run is read for, and the records of one file share that clock.
"""

from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from servelab.analyze.summary import summarize
from servelab.bench.manifest import redact, versions
from servelab.bench.workloads.request_plan import TRACE_CLASS
from servelab.rundir import LACKS_TOKEN_TIMES, JsonlAppender, RunDir
from servelab.vocab import ClientRecord

TRACE = "trace.jsonl"  # the run's sends and lengths as a Mooncake trace, for `tune`'s replay

# What a format may lack, as the manifest's ``imported.lacks`` names it.
LACKS = {
    LACKS_TOKEN_TIMES: "per-token times: each request's first token time, its end and its "
    "token counts only (no ITL; no engine steps can be inferred)",
    "chunk_tokens": "tokens per chunk: each chunk is taken to carry one token",
    "server_id": "the id the server knew each request by",
}


class UnreadableImport(ValueError):
    """The file is not a readable result of the format; the message says what to pass."""


@dataclass(kw_only=True)
class Imported:
    """One tool's results in servelab's vocabulary (see the module doc)."""

    tool: str  # "guidellm", "vllm bench serve", "aiperf"
    version: str | None
    records: list[ClientRecord]
    lacks: list[str] = field(default_factory=list)
    model: str | None = None
    url: str | None = None
    load: dict[str, Any] | None = None  # the tool's load settings, as it recorded them
    concurrency: int | None = None  # the closed loop's streams; None: sent at measured times
    endpoint: str = "completions"  # or "chat": how the prompts were sent
    clock: str = "the tool's wall clock (seconds)"  # the clock of every record's times
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        unknown = [k for k in self.lacks if k not in LACKS]
        if unknown:
            raise ValueError(f"unknown lack {unknown}: use {', '.join(LACKS)}")


def write_imported(
    imp: Imported,
    source: Path,
    out: str | Path,
    *,
    command: list[str],
    server_config: str | None = None,
) -> Path:
    """Write ``imp`` (read from ``source``) as a run directory at ``out``; return it.

    ``command``: the importing command line (secrets redacted here); ``server_config``: the
    server's launch command or flags as the user states them (recorded as bench
    ``--server-config`` records it, for ``calibrate`` and ``tune``). ValueError when ``out``
    already holds a run or ``imp`` has no record."""
    if not imp.records:
        raise UnreadableImport(f"{source} holds no request to import")
    run = RunDir(out)
    records = _as_planned(imp.records)
    (run.path / TRACE).unlink(missing_ok=True)  # a failed import's, never appended to
    trace = JsonlAppender(run.path / TRACE)
    try:
        t0 = records[0].actual_send
        for rec in records:
            run.add_record(rec)
            trace.write(
                {
                    "timestamp": (rec.actual_send - t0) * 1e3,
                    "input_length": rec.input_tokens,
                    "output_length": rec.requested_output_tokens or max(1, rec.output_tokens),
                }
            )
    finally:
        run.close()
        trace.close()
    metrics = summarize(records)
    run.write_json("metrics.json", metrics)
    # relative: the replay finds it in the run directory, wherever the directory moves
    load = {"trace": TRACE, "concurrency": imp.concurrency}
    server: dict[str, Any] = {"kind": "other", "url": imp.url, "model": imp.model}
    if server_config:
        server["stated_command"] = redact(shlex.split(server_config))
    run.write_manifest(
        {
            "name": run.path.name,
            "command": shlex.join(redact(command)),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "versions": versions(),
            "target_kind": "other",
            "server": server,
            "model": imp.model,
            "tokenizer": imp.model,
            "workload": {"trace": load["trace"]},
            "config": {"endpoint": imp.endpoint, "seed": 0, "load": load, "tool_load": imp.load},
            "window": metrics["window"],
            "imported": {
                "tool": imp.tool,
                "version": imp.version,
                "file": source.name,
                "sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
                "lacks": list(imp.lacks),
                "notes": list(imp.notes),
                "clock": imp.clock,
            },
            "valid": True,
            "invalid_reason": None,
            "warnings": [LACKS[k] for k in imp.lacks],
            "simulated": False,
        }
    )
    return run.path


def _as_planned(records: list[ClientRecord]) -> list[ClientRecord]:
    """The records in send order, each named as the replay's planner names the trace row
    it wrote (``r000000``, ...); the ids the tool sent or the server gave stay in
    ``sent_request_id``, ``server_request_id`` and ``response_id``."""
    ordered = sorted(records, key=lambda r: r.actual_send)
    for i, rec in enumerate(ordered):
        rec.request_id = f"r{i:06d}"
        rec.workload_class = TRACE_CLASS
    return ordered
