"""vLLM's per-request OpenTelemetry spans (``--otlp-traces-endpoint``), as OTLP JSON.

The file holds OTLP trace exports in their JSON encoding, one per line (what the OpenTelemetry
Collector's ``file`` exporter writes) or one document: ``resourceSpans[].scopeSpans[].spans[]``.
vLLM ends one ``llm_request`` span per request (``vllm/v1/engine/output_processor.py``,
``do_tracing``), started at the request's arrival (``startTimeUnixNano``, the server's wall
clock), with the attributes read here (seconds, token counts): ``gen_ai.request.id``,
``gen_ai.latency.time_to_first_token`` and ``gen_ai.latency.e2e`` (from the arrival),
``gen_ai.latency.time_in_queue``, ``gen_ai.latency.time_in_model_prefill`` and
``..._decode``, ``gen_ai.usage.prompt_tokens`` and ``..._completion_tokens``,
``gen_ai.request.max_tokens``.

These are the server's times, not a client's: a record's send is its arrival at vLLM, so
TTFT and E2E hold no network or client time, and there is no time per token (the run
``lacks`` them). The queue, prefill and decode times become the record's server figures, as
vLLM's response ``metrics`` would (``reported_by``: ``vllm otel span``), so the diagnosis
splits TTFT into queue and prefill as vLLM measured them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from servelab.bench.imports.imported import Imported, UnreadableImport
from servelab.rundir import LACKS_TOKEN_TIMES
from servelab.vocab import ClientRecord, RequestTags

TOOL = "vllm otel spans"
SPAN = "llm_request"
REPORTED_BY = "vllm otel span"
_FIGURES = (
    ("gen_ai.latency.time_in_queue", "queue_time"),
    ("gen_ai.latency.time_in_model_prefill", "prefill_time"),
    ("gen_ai.latency.time_in_model_decode", "decode_time"),
)


def looks_like(doc: Any) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("resourceSpans"), list)


def read(path: Path) -> Imported:
    text = path.read_text(encoding="utf-8")
    try:
        docs = [json.loads(text)]
    except json.JSONDecodeError:
        try:
            docs = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise UnreadableImport(f"{path} is not OTLP JSON ({e})") from None
    if not docs or not all(looks_like(d) for d in docs):
        raise UnreadableImport(f"{path} is not OTLP trace JSON (no resourceSpans)")
    spans = [
        s
        for d in docs
        for rs in d["resourceSpans"]
        for ss in rs.get("scopeSpans") or []
        for s in ss.get("spans") or []
        if s.get("name") == SPAN
    ]
    if not spans:
        raise UnreadableImport(f"{path} holds no vLLM {SPAN} span")
    records = [_record(s) for s in spans]
    return Imported(
        tool=TOOL,
        version=None,
        records=records,
        lacks=[LACKS_TOKEN_TIMES],
        clock="vLLM's wall clock (seconds)",
        notes=[
            "the server's own times: each request's send is its arrival at vLLM, so TTFT "
            "and E2E hold no network or client time",
            "the spans do not record vLLM's version",
        ],
    )


def _attributes(span: dict[str, Any]) -> dict[str, Any]:
    """An OTLP span's attributes as plain values (``intValue`` is a string in OTLP JSON)."""
    out: dict[str, Any] = {}
    for a in span.get("attributes") or []:
        v = a.get("value") or {}
        if "doubleValue" in v:
            out[a["key"]] = float(v["doubleValue"])
        elif "intValue" in v:
            out[a["key"]] = int(v["intValue"])
        elif "stringValue" in v:
            out[a["key"]] = v["stringValue"]
    return out


def _record(span: dict[str, Any]) -> ClientRecord:
    attrs = _attributes(span)
    arrival = int(span["startTimeUnixNano"]) * 1e-9
    rec = ClientRecord.for_request(
        str(attrs.get("gen_ai.request.id") or span.get("spanId")),
        RequestTags(),
        stage=None,
        intended_send=arrival,
        actual_send=arrival,
        input_tokens=int(attrs.get("gen_ai.usage.prompt_tokens") or 0),
        requested_output_tokens=attrs.get("gen_ai.request.max_tokens"),
    )
    rec.server_request_id = attrs.get("gen_ai.request.id")
    rec.output_tokens = int(attrs.get("gen_ai.usage.completion_tokens") or 0)
    ttft = attrs.get("gen_ai.latency.time_to_first_token")
    if ttft is not None:
        rec.chunk_times = [arrival + float(ttft)]
        rec.chunk_tokens = [1]
        rec.first_byte = rec.chunk_times[0]
    e2e = attrs.get("gen_ai.latency.e2e")
    rec.done = arrival + float(e2e) if e2e is not None else None
    figures = {key: float(attrs[src]) for src, key in _FIGURES if src in attrs}
    if figures:
        rec.server_timeline = {**figures, "reported_by": REPORTED_BY}
    return rec
