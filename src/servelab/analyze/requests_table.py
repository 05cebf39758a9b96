"""A run's requests as one flat table, for dataframes and warehouses (``servelab export``).

One row per request of ``requests.jsonl``, in file order, with the run's name beside it (so
the tables of several runs concatenate). Columns (``COLUMNS``): identity and class, the send
times relative to the run's first send (seconds), token counts and their source, the
per-request latencies of docs/metrics.md in seconds (``ttft``, ``ttfo``, ``ttft_intended``,
``tpot``, ``e2e``, ``itl_mean``, ``itl_max``), ``ok``, the error kind and message. A value a
request does not have is empty (CSV) or null (Parquet).

CSV needs nothing beyond Python; Parquet needs ``pyarrow`` (it comes with
``pip install 'servelab[datasets]'``), and ``write_parquet`` raises ``MissingPyarrow`` without it.
"""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path
from typing import Any

from servelab.rundir import Run
from servelab.vocab import ClientRecord

COLUMNS = (
    "run",
    "request_id",
    "workload_class",
    "stage",
    "session_id",
    "turn",
    "intended_send_s",
    "actual_send_s",
    "send_lag_s",
    "stream",
    "status",
    "ok",
    "error_kind",
    "error",
    "input_tokens",
    "output_tokens",
    "token_source",
    "client_output_tokens",
    "disputed_usage",
    "cached_tokens",
    "reasoning_tokens",
    "ttft",
    "ttfo",
    "ttft_intended",
    "tpot",
    "e2e",
    "itl_mean",
    "itl_max",
    "chunks",
)


class MissingPyarrow(RuntimeError):
    """Parquet was asked for without pyarrow installed."""


def _row(run_name: str, t0: float, r: ClientRecord) -> dict[str, Any]:
    gaps = r.itls
    return {
        "run": run_name,
        "request_id": r.request_id,
        "workload_class": r.workload_class,
        "stage": r.stage,
        "session_id": r.session_id,
        "turn": r.turn,
        "intended_send_s": r.intended_send - t0,
        "actual_send_s": r.actual_send - t0,
        "send_lag_s": r.send_lag,
        "stream": r.stream,
        "status": r.status,
        "ok": r.ok,
        "error_kind": None if r.error is None else r.error.split(":", 1)[0],
        "error": r.error,
        "input_tokens": r.input_tokens,
        "output_tokens": r.output_tokens,
        "token_source": r.token_source,
        "client_output_tokens": r.client_output_tokens,
        "disputed_usage": r.disputed_usage,
        "cached_tokens": r.cached_tokens,
        "reasoning_tokens": r.reasoning_tokens,
        "ttft": r.ttft,
        "ttfo": r.ttfo,
        "ttft_intended": r.ttft_intended,
        "tpot": r.tpot,
        "e2e": r.e2e,
        "itl_mean": sum(gaps) / len(gaps) if gaps else None,
        "itl_max": max(gaps) if gaps else None,
        "chunks": len(r.chunk_times),
    }


def request_rows(run: Run) -> list[dict[str, Any]]:
    """The run's table as dicts keyed by ``COLUMNS``."""
    t0 = min((r.actual_send for r in run.records), default=0.0)
    return [_row(run.name, t0, r) for r in run.records]


def write_csv(rows: list[dict[str, Any]], path: Path) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    return path


def write_parquet(rows: list[dict[str, Any]], path: Path) -> Path:
    if importlib.util.find_spec("pyarrow") is None:
        raise MissingPyarrow(
            "Parquet needs pyarrow, which is not installed: pip install pyarrow "
            "(or 'servelab[datasets]'), or export --format csv"
        )
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows, schema=_arrow_schema(pa))
    pq.write_table(table, path)
    return path


def _arrow_schema(pa: Any) -> Any:
    """Fixed column types, so an all-empty column (no errors, no sessions) is still typed."""
    kinds = {
        "turn": pa.int64(),
        "status": pa.int64(),
        "input_tokens": pa.int64(),
        "output_tokens": pa.int64(),
        "client_output_tokens": pa.int64(),
        "disputed_usage": pa.int64(),
        "cached_tokens": pa.int64(),
        "reasoning_tokens": pa.int64(),
        "chunks": pa.int64(),
        "stream": pa.bool_(),
        "ok": pa.bool_(),
    }
    strings = {"run", "request_id", "workload_class", "stage", "session_id", "error_kind"}
    strings |= {"error", "token_source"}
    return pa.schema(
        [(c, kinds.get(c, pa.string() if c in strings else pa.float64())) for c in COLUMNS]
    )
