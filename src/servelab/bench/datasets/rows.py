"""Line- and row-oriented dataset files: OpenAI chat JSONL, OpenAI Batch input, plain JSONL,
CSV and Parquet. Each reader yields ``(where, row)`` pairs, ``where`` naming the line or row
for error messages."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"line {n}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path} line {n}: not a JSON object ({e.msg} at column {e.colno}); "
                    "expected one JSON object per line"
                ) from None


def csv_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8", errors="replace", newline="") as f:
        reader = csv.DictReader(f)
        try:
            for row in reader:
                yield f"line {reader.line_num}", row
        except csv.Error as e:
            raise ValueError(f"{path} line {reader.line_num}: not valid CSV: {e}") from None


def parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ModuleNotFoundError:
        raise ValueError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises its own types for bad files
        raise ValueError(f"{path}: not a readable Parquet file: {e}") from None
    for n, row in enumerate(table.to_pylist()):
        yield f"row {n}", row


def text_of(content: Any) -> str | None:
    """A message's text: a string, or the text parts of OpenAI's list-of-parts form."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        ]
        return "".join(parts)
    return None
