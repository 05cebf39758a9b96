"""GuideLLM's results JSON (``guidellm run --output kind=json``; read from 0.8's layout).

Each benchmark's ``requests`` lists ``successful``, ``errored`` and ``incomplete`` requests;
each request's ``info.timings`` holds the scheduler's target send (``targeted_start``), the
actual send (``request_start``), the first and last token iterations, the end and the
number of token-bearing iterations, and the request its token counts. GuideLLM keeps no time
per token, so a record carries its first token chunk alone (``chunk_times``: the first
token's arrival) and its end: TTFT, TPOT and E2E are exact, ITL is absent, and the run
``lacks`` per-token times. Several benchmarks in one file (a sweep) become sweep stages
named by their strategy. Against vLLM with ``--enable-per-request-metrics`` GuideLLM passes
vLLM's response ``metrics`` through (``response_metrics``): they become the record's server
figures, as ``servelab bench`` reads them (``bench.client.serverfigures``).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from servelab.bench.client.serverfigures import MalformedFigures, ignored, read_figures
from servelab.bench.imports.imported import Imported, UnreadableImport
from servelab.rundir import LACKS_TOKEN_TIMES
from servelab.vocab import ClientRecord, RequestTags

TOOL = "guidellm"
_GROUPS = (("successful", None), ("errored", "error"), ("incomplete", "incomplete"))


def looks_like(doc: Any) -> bool:
    return isinstance(doc, dict) and "guidellm_version" in (doc.get("metadata") or {})


def read(path: Path) -> Imported:
    doc = json.loads(path.read_text(encoding="utf-8"))
    if not looks_like(doc) or not isinstance(doc.get("benchmarks"), list):
        raise UnreadableImport(
            f"{path} is not a GuideLLM results JSON (no metadata.guidellm_version)"
        )
    benches = doc["benchmarks"]
    records: list[ClientRecord] = []
    stages = [_stage(b) for b in benches] if len(benches) > 1 else [None] * len(benches)
    reqs = [(r, kind, stage) for b, stage in zip(benches, stages) for r, kind in _requests(b)]
    turns = Counter(str((r.get("info") or {}).get("conversation_id")) for r, _, _ in reqs)
    for req, kind, stage in reqs:
        rec = _record(req, kind, stage, turns)
        if rec is not None:
            records.append(rec)
    first = benches[0] if benches else {}
    strategy = (first.get("config") or {}).get("strategy")
    backend = ((doc.get("config") or {}).get("spec") or {}).get("backend") or {}
    return Imported(
        tool=TOOL,
        version=str(doc["metadata"]["guidellm_version"]),
        records=records,
        lacks=[LACKS_TOKEN_TIMES],
        model=backend.get("model"),
        url=backend.get("target"),
        load={"strategy": strategy} if strategy else None,
        concurrency=_streams(strategy or {}),
        endpoint="chat" if "chat" in str(backend.get("request_format")) else "completions",
        notes=["GuideLLM times each request's first and last token, not each token"],
    )


def _streams(strategy: dict[str, Any]) -> int | None:
    """The closed loop's streams of a GuideLLM strategy; None for one that sends on a
    schedule (constant, poisson)."""
    kind = strategy.get("type_")
    if kind == "synchronous":
        return 1
    if kind in ("concurrent", "throughput"):
        streams = strategy.get("streams") or strategy.get("max_concurrency")
        return int(streams) if streams else None
    return None


def _stage(bench: dict[str, Any]) -> str:
    strategy = (bench.get("config") or {}).get("strategy") or {}
    kind = strategy.get("type_", "benchmark")
    rate = strategy.get("rate") or strategy.get("streams")
    return f"{kind}@{rate}" if rate is not None else str(kind)


def _requests(bench: dict[str, Any]) -> list[tuple[dict[str, Any], str | None]]:
    groups = bench.get("requests") or {}
    return [(r, kind) for key, kind in _GROUPS for r in (groups.get(key) or [])]


def _body(req: dict[str, Any]) -> dict[str, Any]:
    try:
        args = json.loads(req.get("request_args") or "{}")
    except json.JSONDecodeError:
        return {}
    return args.get("body") or {} if isinstance(args, dict) else {}


def _record(
    req: dict[str, Any], kind: str | None, stage: str | None, turns: Counter[str]
) -> ClientRecord | None:
    info = req.get("info") or {}
    t = info.get("timings") or {}
    sent = t.get("request_start")
    if sent is None:
        return None  # never sent: nothing the server saw
    body = _body(req)
    conv = str(info.get("conversation_id"))
    tags = RequestTags(
        session_id=conv if turns[conv] > 1 else None,
        turn=int(info.get("turn_index") or 0),
        stream=bool(body.get("stream", True)),
    )
    error = None
    if kind is not None:
        error = str(info.get("error") or req.get("error") or f"{kind} (GuideLLM)")
    rec = ClientRecord.for_request(
        str(info.get("request_id") or req.get("request_id")),
        tags,
        stage=stage,
        intended_send=float(t.get("targeted_start") or sent),
        actual_send=float(sent),
        input_tokens=int(req.get("prompt_tokens") or 0),
        requested_output_tokens=body.get("max_tokens"),
        error=error,
    )
    rec.output_tokens = int(req.get("output_tokens") or 0)
    rec.response_id = req.get("response_id")
    first = t.get("first_token_iteration")
    if first is not None:
        rec.first_byte = float(t.get("first_request_iteration") or first)
        rec.chunk_times = [float(first)]
        rec.chunk_tokens = [1]
        out_first = t.get("first_output_token_iteration")
        rec.first_output = float(out_first) if out_first is not None else None
    end = t.get("request_end") or t.get("last_request_iteration") or t.get("resolve_end")
    rec.done = float(end) if end is not None else None
    rec.status = 200 if kind is None else None
    try:
        rec.server_timeline = read_figures("metrics", req.get("response_metrics"))
    except MalformedFigures as e:
        rec.server_timeline = ignored(str(e))
    return rec
