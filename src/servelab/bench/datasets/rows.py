"""Line- and row-oriented dataset files: OpenAI chat JSONL, OpenAI Batch input, plain JSONL,
CSV and Parquet. Each reader yields ``(where, row)`` pairs, ``where`` naming the line or row
for error messages."""

from __future__ import annotations

import csv
import json
import os
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


HF_FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json"}


def hf_disk_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """A Hugging Face dataset folder, read offline: one written by ``save_to_disk`` (a
    DatasetDict's ``train`` split, or its only one), or a folder of parquet, arrow or jsonl
    files. Nothing touches the network: the library's offline switches are set first."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ModuleNotFoundError:
        raise ValueError(
            f"{path}: reading a Hugging Face dataset folder needs the datasets library "
            "(pip install 'servelab[datasets]')"
        ) from None
    try:
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            data = datasets.load_from_disk(str(path))
        else:
            files = sorted(p for p in path.rglob("*") if p.suffix.lower() in HF_FILE_BUILDERS)
            kinds = {HF_FILE_BUILDERS[p.suffix.lower()] for p in files}
            if len(kinds) != 1:
                found = sorted({p.suffix for p in path.rglob("*") if p.is_file()})
                raise ValueError(
                    f"{path}: expected a save_to_disk folder or files of one kind "
                    f"({', '.join(sorted(HF_FILE_BUILDERS))}); found {found or 'no files'}"
                )
            data = datasets.load_dataset(kinds.pop(), data_files=[str(p) for p in files])
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - the library raises many types for bad folders
        raise ValueError(f"{path}: not a readable Hugging Face dataset: {e}") from None
    if isinstance(data, datasets.DatasetDict):
        split = "train" if "train" in data else next(iter(data))
        data = data[split]
    for n, row in enumerate(data):
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
