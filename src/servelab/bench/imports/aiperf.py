"""AIPerf's per-request export (``aiperf profile --export-level records``: ``profile_export.jsonl``).

One JSON line per request: ``metadata`` (the send as wall-clock ``request_start_ns``, the
end, the ``X-Request-Id`` it sent, the conversation and turn, the benchmark phase) and
``metrics`` (``time_to_first_token`` and ``inter_chunk_latency``, the gaps between the
content-bearing chunks, in ms; token counts), and ``error`` for a failed one. The chunk
times are rebuilt as the send plus TTFT plus the running sum of the gaps: AIPerf measures
both from that send. Only the ``profiling`` phase is read (warm-up requests are not part
of the measurement). Where a chunk count equals the request's output tokens each chunk
carried one; otherwise the tokens per chunk are unknown (``lacks`` ``chunk_tokens``).
``profile_export_aiperf.json`` beside the file, where present, gives AIPerf's version, the
model, the URL and the load.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

from servelab.bench.imports.imported import Imported, UnreadableImport
from servelab.vocab import ClientRecord, RequestTags

TOOL = "aiperf"
RECORDS = "profile_export.jsonl"
SUMMARY = "profile_export_aiperf.json"
_SCALE = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0}


def looks_like(first_line: Any) -> bool:
    return (
        isinstance(first_line, dict)
        and "request_start_ns" in (first_line.get("metadata") or {})
        and isinstance(first_line.get("metrics"), dict)
    )


def read(path: Path) -> Imported:
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise UnreadableImport(f"{path}:{n} is not JSON ({e})") from None
    if not rows or not looks_like(rows[0]):
        raise UnreadableImport(f"{path} is not an AIPerf {RECORDS} (no metadata.request_start_ns)")
    rows = [r for r in rows if (r["metadata"].get("benchmark_phase") or "profiling") == "profiling"]
    turns = Counter(str(r["metadata"].get("conversation_id")) for r in rows)
    records = [_record(r, turns) for r in rows]
    lacks = []
    if any(r.chunk_times and not r.chunk_tokens for r in records):
        lacks.append("chunk_tokens")
    summary = _summary(path.with_name(SUMMARY))
    config = summary.get("input_config") or {}
    endpoint = config.get("endpoint") or {}
    models = (config.get("models") or {}).get("items") or [{}]
    phases = config.get("phases") or []
    return Imported(
        tool=TOOL,
        version=summary.get("aiperf_version"),
        records=records,
        lacks=lacks,
        model=models[0].get("name"),
        url=(endpoint.get("urls") or [None])[0],
        load=phases[0] if phases else None,
        concurrency=_concurrency(phases[0] if phases else {}),
        endpoint="chat" if endpoint.get("type") == "chat" else "completions",
        notes=[] if summary else [f"no {SUMMARY} beside the file: AIPerf's version unknown"],
    )


def _concurrency(phase: dict[str, Any]) -> int | None:
    """A concurrency phase's streams; None for one sent at a request rate."""
    if phase.get("type") == "concurrency" and phase.get("concurrency"):
        return int(phase["concurrency"])
    return None


def _summary(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _seconds(metrics: dict[str, Any], name: str) -> Any:
    """The metric in seconds (a number or a list), None where it is absent."""
    m = metrics.get(name)
    if not isinstance(m, dict) or m.get("value") is None:
        return None
    scale = _SCALE.get(str(m.get("unit")))
    if scale is None:
        raise UnreadableImport(f"metric {name} has an unknown unit {m.get('unit')!r}")
    v = m["value"]
    return [float(x) * scale for x in v] if isinstance(v, list) else float(v) * scale


def _count(metrics: dict[str, Any], *names: str) -> int:
    for name in names:
        m = metrics.get(name)
        if isinstance(m, dict) and isinstance(m.get("value"), int | float):
            return int(m["value"])
    return 0


def _record(row: dict[str, Any], turns: Counter[str]) -> ClientRecord:
    meta, metrics = row["metadata"], row["metrics"]
    sent = meta["request_start_ns"] * 1e-9
    issued = meta.get("credit_issued_ns")
    conv = str(meta.get("conversation_id"))
    err = row.get("error")
    error = None
    if err:
        error = (
            str(err.get("message") or err.get("type") or "error")
            if isinstance(err, dict)
            else str(err)
        )
    rec = ClientRecord.for_request(
        str(meta.get("x_request_id") or f"aiperf-{meta.get('session_num')}"),
        RequestTags(
            session_id=conv if turns[conv] > 1 else None, turn=int(meta.get("turn_index") or 0)
        ),
        stage=None,
        intended_send=issued * 1e-9 if issued else sent,
        actual_send=sent,
        input_tokens=_count(metrics, "input_sequence_length", "usage_prompt_tokens"),
        requested_output_tokens=None,
        error=error,
    )
    rec.sent_request_id = meta.get("x_request_id")
    rec.output_tokens = _count(metrics, "output_sequence_length", "usage_completion_tokens")
    rec.done = meta["request_end_ns"] * 1e-9
    ttft = _seconds(metrics, "time_to_first_token")
    if ttft is not None:
        gaps = _seconds(metrics, "inter_chunk_latency") or []
        rec.chunk_times = [sent + t for t in itertools.accumulate([ttft, *gaps])]
        if len(rec.chunk_times) == rec.output_tokens:
            rec.chunk_tokens = [1] * len(rec.chunk_times)
        rec.first_byte = rec.chunk_times[0]
    if error is None:
        rec.status = 200
    elif isinstance(err, dict) and isinstance(err.get("code"), int):
        rec.status = err["code"]
    return rec
