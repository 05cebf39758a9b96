"""A ``vllm bench serve --save-result --save-detailed`` result JSON (read from vLLM 0.32's layout).

The detailed result holds one entry per request in each of its lists, in request order:
``start_times`` (the client's ``perf_counter`` at the send, one clock for the run),
``ttfts``, ``itls`` (the gap before each later token-bearing chunk), ``latencies`` (send
to the last chunk), ``input_lens``, ``output_lens``, ``queue_times`` (time spent waiting
for the client's concurrency limit: in a run at a request rate the intended send is that
much earlier; at rate ``inf`` it is a closed loop, whose requests are due as a stream
frees) and ``errors``.
The chunk times are the send plus TTFT plus the running sum of the gaps. The file records
neither vLLM's version nor the request ids it sent, so the records carry the list index.
Without ``start_times`` (a result saved without ``--save-detailed``) there is nothing per
request to import.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from servelab.bench.imports.imported import Imported, UnreadableImport
from servelab.vocab import ClientRecord, RequestTags

TOOL = "vllm bench serve"
_PER_REQUEST = ("start_times", "ttfts", "itls", "latencies", "input_lens", "output_lens")


def looks_like(doc: Any) -> bool:
    return isinstance(doc, dict) and "ttfts" in doc and "backend" in doc


def read(path: Path) -> Imported:
    doc = json.loads(path.read_text(encoding="utf-8"))
    if not looks_like(doc):
        raise UnreadableImport(f"{path} is not a `vllm bench serve --save-result` JSON (no ttfts)")
    missing = [k for k in _PER_REQUEST if not isinstance(doc.get(k), list)]
    if missing:
        raise UnreadableImport(
            f"{path} has no per-request {', '.join(missing)}: save it with "
            "`vllm bench serve --save-result --save-detailed`"
        )
    n = len(doc["start_times"])
    closed = doc.get("max_concurrency") if doc.get("request_rate") == "inf" else None
    # A closed loop's request is due when a stream frees: its wait for the concurrency
    # limit is the loop itself, not the client falling behind a schedule.
    queue = doc.get("queue_times") if closed is None else None
    queue = queue or [0.0] * n
    errors = doc.get("errors") or [""] * n
    records = [
        _record(i, doc, float(queue[i] or 0.0), str(errors[i] or "") or None) for i in range(n)
    ]
    lacks = ["server_id"]
    if any(r.chunk_times and not r.chunk_tokens for r in records):
        lacks.append("chunk_tokens")
    return Imported(
        tool=TOOL,
        version=None,
        records=records,
        lacks=lacks,
        model=doc.get("model_id"),
        url=None,
        load={
            k: doc.get(k)
            for k in ("request_rate", "burstiness", "max_concurrency", "num_prompts")
            if k in doc
        },
        concurrency=closed,
        endpoint="chat" if "chat" in str(doc.get("backend")) else "completions",
        clock="the client's perf_counter (seconds)",
        notes=["vllm bench serve records neither vLLM's version nor the request ids it sent"],
    )


def _record(i: int, doc: dict[str, Any], queued: float, error: str | None) -> ClientRecord:
    sent = float(doc["start_times"][i])
    rec = ClientRecord.for_request(
        f"vllm-bench-{i}",
        RequestTags(),
        stage=None,
        intended_send=sent - queued,
        actual_send=sent,
        input_tokens=int(doc["input_lens"][i] or 0),
        requested_output_tokens=None,
        error=error,
    )
    rec.output_tokens = int(doc["output_lens"][i] or 0)
    ttft = doc["ttfts"][i]
    if error is None and ttft:
        gaps = [float(g) for g in doc["itls"][i] or []]
        rec.chunk_times = [sent + t for t in itertools.accumulate([float(ttft), *gaps])]
        if len(rec.chunk_times) == rec.output_tokens:
            rec.chunk_tokens = [1] * len(rec.chunk_times)
        rec.first_byte = rec.chunk_times[0]
        rec.done = sent + float(doc["latencies"][i])
        rec.status = 200
    return rec
