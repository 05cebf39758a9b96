"""Datasets of real prompts and conversations, for ``servelab bench --dataset``.

``load_dataset(src, fmt, field)`` reads a file (or the named offline ``sharegpt``) into
``Conversation``s: the messages as recorded (roles ``system``/``user``/``assistant``), plus an
output length where the file gives one. Formats (``FORMATS``) are detected from the file's
name and first record, or named with ``--dataset-format``. Every error says which file,
which line or record, and what was expected; nothing is sent before the file is read.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servelab.bench.datasets import rows, sharegpt


class DatasetError(ValueError):
    """A dataset file that cannot be used: where, and what was expected (shown to the user
    as one line, like every ValueError of the bench)."""


FORMATS = ("sharegpt", "openai-chat", "openai-batch", "jsonl", "csv", "parquet", "hf-disk")
_ROW_FORMATS = ("jsonl", "csv", "parquet", "hf-disk")  # one prompt per row, in a field
DEFAULT_FIELD = "prompt"
# Output-length columns of row formats, in the order they are looked for.
LENGTH_FIELDS = ("output_len", "output_tokens", "max_tokens", "max_completion_tokens")
_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}


@dataclass
class Conversation:
    """One record: its messages in order, and the output length the file asks for."""

    id: str
    messages: list[tuple[str, str]]
    output_len: int | None = None


@dataclass
class Dataset:
    conversations: list[Conversation]
    info: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def resolve(src: str) -> tuple[Path, str | None]:
    """The file behind ``src`` and the name it was given by (None for a path)."""
    if src == sharegpt.NAMED and not Path(src).exists():
        return sharegpt.named_path(), sharegpt.NAMED
    path = Path(src)
    if not path.is_file() and not path.is_dir():
        raise DatasetError(
            f"dataset {src!r} is neither a file nor a named source ({sharegpt.NAMED})"
        )
    return path, None


def detect(path: Path) -> str:
    """The format of ``path``, from its suffix and, for JSONL, its first record's keys."""
    if path.is_dir():
        return "hf-disk"
    suffix = path.suffix.lower()
    if suffix == ".json":
        return "sharegpt"
    if suffix == ".csv":
        return "csv"
    if suffix == ".parquet":
        return "parquet"
    if suffix == ".jsonl":
        for _where, row in rows.jsonl_rows(path):
            if isinstance(row, dict) and "messages" in row:
                return "openai-chat"
            if isinstance(row, dict) and "body" in row and "custom_id" in row:
                return "openai-batch"
            return "jsonl"
        raise DatasetError(f"{path} is empty")
    raise DatasetError(
        f"cannot tell the format of {path} from its name; give --dataset-format "
        f"({', '.join(FORMATS)})"
    )


def load_dataset(src: str, fmt: str | None = None, field_name: str | None = None) -> Dataset:
    """Read every record of ``src``; ValueError with the place and the expectation if not."""
    if fmt is not None and fmt not in FORMATS:
        raise DatasetError(f"unknown --dataset-format {fmt!r}; formats: {', '.join(FORMATS)}")
    path, name = resolve(src)
    fmt = fmt or detect(path)
    if field_name is not None and fmt not in _ROW_FORMATS:
        raise DatasetError(f"--dataset-field applies to {', '.join(_ROW_FORMATS)}, not {fmt}")
    if (fmt == "hf-disk") != path.is_dir():
        raise DatasetError(f"{path}: the hf-disk format is a folder, every other format one file")
    ds = Dataset([])
    label = name or str(path)
    if fmt == "sharegpt":
        cuts: list[sharegpt.Cut] = []
        for i, rec in enumerate(sharegpt.iter_records(path, cuts)):
            ds.conversations.append(_sharegpt(rec, i, path))
        if cuts:
            if not ds.conversations:
                raise DatasetError(
                    f"{path}: no whole record before byte {cuts[0].offset}: {cuts[0].reason}"
                )
            ds.warnings.append(
                f"{label} is cut off or corrupt at byte {cuts[0].offset:,} ({cuts[0].reason}); "
                f"recovered the {len(ds.conversations):,} whole records before it"
            )
        truncated = {"offset": cuts[0].offset, "reason": cuts[0].reason} if cuts else None
    else:
        readers = {"csv": rows.csv_rows, "parquet": rows.parquet_rows, "hf-disk": rows.hf_disk_rows}
        reader = readers.get(fmt, rows.jsonl_rows)
        convert = {"openai-chat": _openai_chat, "openai-batch": _openai_batch}.get(fmt)
        for where, row in reader(path):
            if convert is None and field_name is None and fmt == "hf-disk":
                convert = _hf_converter(row)  # a conversation dataset, or prompts in a field
            if convert is not None:
                ds.conversations.append(convert(row, where, path))
            else:
                ds.conversations.append(_prompt_row(row, where, path, field_name or DEFAULT_FIELD))
        truncated = None
    if not ds.conversations:
        raise DatasetError(f"{path} holds no records")
    ds.info = {
        "source": name or str(path),
        "path": str(path) if name is None else f"{name} (package data)",
        "sha256": _sha256(path),
        "format": fmt,
        "field": field_name if fmt in _ROW_FORMATS else None,
        "records_read": len(ds.conversations),
        "truncated": truncated,
    }
    return ds


def _sha256(path: Path) -> str:
    """Of the file; of a folder, of every file's relative path and bytes, in sorted order."""
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if not p.is_file():
            continue
        if path.is_dir():
            h.update(str(p.relative_to(path)).encode() + b"\0")
        with p.open("rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    return h.hexdigest()


def _hf_converter(row: Any) -> Any:
    """How to read a Hugging Face dataset's rows, from the first one: ShareGPT-style
    ``conversations``, OpenAI-style ``messages``, or (None) a prompt field."""
    if isinstance(row, dict) and "conversations" in row:
        return lambda r, where, path: _sharegpt(r, int(where.split()[-1]), path)
    if isinstance(row, dict) and "messages" in row:
        return _openai_chat
    return None


def _not_a(expected: str, rec: Any, where: str, path: Path) -> DatasetError:
    """The error for a record that is not ``expected``, naming what it holds instead."""
    found = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
    return DatasetError(f"{path} {where}: expected {expected}; found {found}")


def _sharegpt(rec: Any, i: int, path: Path) -> Conversation:
    turns = rec.get("conversations") if isinstance(rec, dict) else None
    if not isinstance(turns, list):
        raise _not_a(
            "an object with 'conversations' (a list of {from, value})", rec, f"record {i}", path
        )
    msgs = []
    for j, t in enumerate(turns):
        if not isinstance(t, dict) or not isinstance(t.get("value"), str):
            raise DatasetError(
                f'{path} record {i} turn {j}: expected {{"from": ..., "value": TEXT}}'
            )
        msgs.append((_ROLES.get(str(t.get("from", "")).lower(), "other"), t["value"]))
    return Conversation(str(rec.get("id", i)), msgs)


def _messages(msgs: Any, where: str, path: Path) -> list[tuple[str, str]]:
    if not isinstance(msgs, list) or not msgs:
        raise DatasetError(
            f"{path} {where}: expected 'messages', a non-empty list of {{role, content}}"
        )
    out = []
    for j, m in enumerate(msgs):
        text = rows.text_of(m.get("content")) if isinstance(m, dict) else None
        if text is None:
            raise DatasetError(
                f'{path} {where} message {j}: expected {{"role": ..., "content": TEXT}}'
            )
        out.append((_ROLES.get(str(m.get("role", "")).lower(), "other"), text))
    return out


def _length(d: dict[str, Any], keys: tuple[str, ...], where: str, path: Path) -> int | None:
    for k in keys:
        v = d.get(k)
        if v is None or v == "":
            continue
        try:
            n = int(float(v))
        except (TypeError, ValueError):
            raise DatasetError(
                f"{path} {where}: {k} must be a number of tokens, got {v!r}"
            ) from None
        if n < 1:
            raise DatasetError(f"{path} {where}: {k} must be >= 1, got {n}")
        return n
    return None


def _openai_chat(row: Any, where: str, path: Path) -> Conversation:
    if not isinstance(row, dict) or "messages" not in row:
        raise _not_a("an object with 'messages'", row, where, path)
    n = _length(row, ("max_completion_tokens", "max_tokens"), where, path)
    return Conversation(str(row.get("id", where)), _messages(row["messages"], where, path), n)


def _openai_batch(row: Any, where: str, path: Path) -> Conversation:
    body = row.get("body") if isinstance(row, dict) else None
    if not isinstance(body, dict):
        raise _not_a("a Batch API line {custom_id, method, url, body}", row, where, path)
    n = _length(body, ("max_completion_tokens", "max_tokens"), where, path)
    rid = str(row.get("custom_id", where))
    if "messages" in body:
        return Conversation(rid, _messages(body["messages"], where, path), n)
    if isinstance(body.get("prompt"), str):
        return Conversation(rid, [("user", body["prompt"])], n)
    raise DatasetError(f"{path} {where}: the body has neither 'messages' nor a 'prompt' string")


def _prompt_row(row: Any, where: str, path: Path, name: str) -> Conversation:
    if not isinstance(row, dict):
        raise DatasetError(f"{path} {where}: expected an object with a {name!r} field")
    if name not in row:
        raise DatasetError(
            f"{path} {where}: no field {name!r}; the fields are {sorted(row)} "
            "(choose one with --dataset-field NAME)"
        )
    text = row[name]
    if not isinstance(text, str):
        raise DatasetError(f"{path} {where}: {name!r} must be text, got {type(text).__name__}")
    return Conversation(
        str(row.get("id", where)), [("user", text)], _length(row, LENGTH_FIELDS, where, path)
    )
