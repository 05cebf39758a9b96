"""Request traces: load, scale in time and length, clip to the model's context.

Formats (detected from the file):
- Azure LLM inference CSV: ``TIMESTAMP,ContextTokens,GeneratedTokens`` (wall-clock times).
- Mooncake JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``
  (one id per 512-token block; equal ids mean an identical prompt prefix).

Named traces ship inside the package (``bench/workloads/traces_data``, with their licences and
citations): ``load_trace("azure-2023-conv")`` or ``load_trace("mooncake-synthetic")``.

``scale_trace`` returns the rows to replay and a report of everything it changed.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, replace
from datetime import datetime
from importlib.resources import files
from pathlib import Path
from typing import Any

MOONCAKE_BLOCK_TOKENS = 512
NAMED_TRACES = {
    "azure-2023-conv": "azure_llm_2023_conv.csv",
    "mooncake-synthetic": "mooncake_fast25_synthetic.jsonl",
}


def trace_path(name_or_path: str | Path) -> Path:
    """The file of a named trace (``NAMED_TRACES``), or ``name_or_path`` as a path."""
    name = str(name_or_path)
    if name in NAMED_TRACES:
        return Path(str(files("servelab.bench.workloads") / "traces_data" / NAMED_TRACES[name]))
    return Path(name_or_path)


@dataclass(frozen=True, kw_only=True)
class TraceRow:
    """One request of a trace: send time (s from the first row), token lengths, and
    for Mooncake the prefix-block ids and their (scaled) block size in tokens."""

    time: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] | None = None
    block_tokens: float = MOONCAKE_BLOCK_TOKENS


def load_trace(path: str | Path) -> tuple[list[TraceRow], str]:
    """Read a trace (a name in ``NAMED_TRACES`` or a file); return its rows (sorted by
    time, starting at 0) and its format."""
    p = trace_path(path)
    if not p.is_file():
        raise ValueError(
            f"trace file {p} does not exist; give a file or one of the named traces: "
            f"{', '.join(NAMED_TRACES)}"
        )
    with p.open() as f:
        first = f.readline().strip()
    if first.startswith("{"):
        rows, fmt = _load_mooncake(p), "mooncake"
    elif "ContextTokens" in first and "GeneratedTokens" in first:
        rows, fmt = _load_azure(p), "azure"
    else:
        raise ValueError(
            f"{p}: unknown trace format; expected an Azure CSV (TIMESTAMP,ContextTokens,"
            "GeneratedTokens) or a Mooncake JSONL (timestamp, input_length, output_length, hash_ids)"
        )
    if not rows:
        raise ValueError(f"trace {p} holds no requests")
    rows.sort(key=lambda r: r.time)
    t0 = rows[0].time
    return [replace(r, time=r.time - t0) for r in rows], fmt


def _load_azure(p: Path) -> list[TraceRow]:
    rows = []
    with p.open(newline="") as f:
        for i, rec in enumerate(csv.DictReader(f)):
            try:
                ts = datetime.fromisoformat(rec["TIMESTAMP"].strip()).timestamp()
                rows.append(
                    TraceRow(
                        time=ts,
                        input_tokens=int(rec["ContextTokens"]),
                        output_tokens=int(rec["GeneratedTokens"]),
                    )
                )
            except (KeyError, ValueError, TypeError) as e:
                raise ValueError(f"{p}: bad row {i + 2}: {e}") from None
    return rows


def _load_mooncake(p: Path) -> list[TraceRow]:
    rows = []
    with p.open() as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                rows.append(
                    TraceRow(
                        time=d["timestamp"] / 1000.0,
                        input_tokens=int(d["input_length"]),
                        output_tokens=int(d["output_length"]),
                        hash_ids=tuple(int(h) for h in d.get("hash_ids", [])) or None,
                    )
                )
            except (KeyError, ValueError, TypeError) as e:
                raise ValueError(f"{p}: bad line {i + 1}: {e}") from None
    return rows


def _stats(rows: list[TraceRow]) -> dict[str, Any]:
    n = len(rows)
    span = rows[-1].time - rows[0].time if n > 1 else 0.0
    return {
        "requests": n,
        "span_s": span,
        "mean_rate": (n - 1) / span if span > 0 else None,
        "mean_input_tokens": sum(r.input_tokens for r in rows) / n if n else None,
        "mean_output_tokens": sum(r.output_tokens for r in rows) / n if n else None,
    }


def scale_trace(
    rows: list[TraceRow],
    *,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    max_model_len: int | None = None,
    max_requests: int | None = None,
    max_duration: float | None = None,
    target_rate: float | None = None,
) -> tuple[list[TraceRow], dict[str, Any]]:
    """Scale and clip a trace for replay; return ``(rows, report)``.

    - times are multiplied by ``time_scale`` (2 = twice as slow); ``target_rate`` instead
      picks the time scale that gives that mean rate;
    - every length (and Mooncake's 512-token block) is multiplied by ``length_scale``,
      rounded, at least 1;
    - then output is clipped to ``max_model_len - 1`` and input to ``max_model_len - output``;
    - finally the first ``max_requests`` rows within ``max_duration`` seconds are kept.
    """
    if not time_scale > 0 or not math.isfinite(time_scale):
        raise ValueError(f"--time-scale must be a positive number, got {time_scale}")
    if not length_scale > 0 or not math.isfinite(length_scale):
        raise ValueError(f"--length-scale must be a positive number, got {length_scale}")
    before = _stats(rows)
    if target_rate is not None:
        if not before["mean_rate"]:
            raise ValueError("cannot set a rate for a trace whose requests all arrive at once")
        time_scale = before["mean_rate"] / target_rate
    out: list[TraceRow] = []
    clipped_in = clipped_out = 0
    for r in rows:
        t = r.time * time_scale
        if max_duration is not None and t > max_duration:
            break
        if max_requests is not None and len(out) >= max_requests:
            break
        inp = max(1, round(r.input_tokens * length_scale))
        outp = max(1, round(r.output_tokens * length_scale))
        if max_model_len is not None:
            if outp > max_model_len - 1:
                outp, clipped_out = max_model_len - 1, clipped_out + 1
            if inp > max_model_len - outp:
                inp, clipped_in = max_model_len - outp, clipped_in + 1
        out.append(
            TraceRow(
                time=t,
                input_tokens=inp,
                output_tokens=outp,
                hash_ids=r.hash_ids,
                block_tokens=MOONCAKE_BLOCK_TOKENS * length_scale,
            )
        )
    if not out:
        raise ValueError("no trace requests left after --duration/--requests; raise the limits")
    report = {
        "time_scale": time_scale,
        "length_scale": length_scale,
        "max_model_len": max_model_len,
        "clipped_inputs": clipped_in,
        "clipped_outputs": clipped_out,
        "original": before,
        "replayed": _stats(out),
    }
    return out, report
