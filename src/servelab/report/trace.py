"""A run as a Chrome Trace Event file (the JSON Perfetto UI and chrome://tracing open).

Process 1 holds one thread per request: its queued spans, each prefill chunk, decode, and
the ITL stalls the client saw. Every engine, per (role, replica), is a process of its own
with one thread of steps. Times are microseconds from the run's first event, on the one
clock client and server share on a host.
"""

from __future__ import annotations

from typing import Any

from servelab.analyze.diagnosis.attribution import Stall
from servelab.rundir import Run

REQUESTS_PID = 1


def _x(name: str, cat: str, start: float, end: float, pid: int, tid: int, **args: Any) -> dict:
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "ts": start,
        "dur": max(end - start, 0.0),
        "pid": pid,
        "tid": tid,
        "args": args,
    }


def _meta(kind: str, name: str, pid: int, tid: int = 0) -> dict:
    return {"name": kind, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": {"name": name}}


def chrome_trace(run: Run, stalls: list[Stall]) -> dict[str, Any]:
    """Every request's phases and every engine step as trace events (``traceEvents``)."""
    events: list[dict] = [_meta("process_name", "requests", REQUESTS_PID)]
    by_request: dict[str, list[Stall]] = {}
    for s in stalls:
        by_request.setdefault(s.request_id, []).append(s)
    for tid, rec in enumerate(run.records, 1):
        events.append(_meta("thread_name", f"{rec.workload_class} {rec.request_id}", 1, tid))
        tl = run.timeline_for(rec)
        if tl is not None:
            for q, adm in zip(tl.queued, tl.scheduled):
                events.append(_x("queued", "queue", q, adm, REQUESTS_PID, tid))
            for c in tl.chunks:
                events.append(
                    _x("prefill chunk", "prefill", c.start, c.end, REQUESTS_PID, tid,
                       tokens=c.tokens, cached_tokens=c.cached_tokens, step=c.step_id)
                )  # fmt: skip
            if tl.first_token is not None and tl.finished is not None:
                events.append(
                    _x("decode", "decode", tl.first_token, tl.finished, REQUESTS_PID, tid,
                       output_tokens=tl.output_tokens)
                )  # fmt: skip
        elif rec.chunk_times and rec.done is not None:
            # Another server: only what the client saw.
            first = rec.chunk_times[0]
            events.append(_x("waiting for first token", "client", rec.actual_send, first, 1, tid))
            events.append(_x("decode", "client", first, rec.done, 1, tid))
        for s in by_request.get(rec.request_id, []):
            events.append(
                _x(f"stall: {s.cause}", "stall", s.at, s.at + s.gap, REQUESTS_PID, tid,
                   gap_ms=s.gap * 1e3, median_gap_ms=s.median_gap * 1e3, detail=s.detail)
            )  # fmt: skip
    engines: dict[tuple[str, int], int] = {}
    for st in run.steps:
        key = (st.role, st.replica)
        if key not in engines:
            engines[key] = REQUESTS_PID + 1 + len(engines)
            events.append(_meta("process_name", f"engine {st.role} {st.replica}", engines[key]))
        events.append(
            _x(f"step {st.step_id}", "step", st.start, st.end, engines[key], 0,
               prefill_tokens=st.prefill_tokens, decode_seqs=st.decode_seqs,
               kv_blocks_used=st.kv_blocks_used, num_waiting=st.num_waiting)
        )  # fmt: skip
    timed = [e for e in events if e["ph"] == "X"]
    t0 = min((e["ts"] for e in timed), default=0.0)
    for e in timed:
        e["ts"] = (e["ts"] - t0) * 1e6
        e["dur"] = e["dur"] * 1e6
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"run": run.name}}
