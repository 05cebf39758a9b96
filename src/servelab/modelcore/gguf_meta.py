"""Fast reader for the key/value metadata of a GGUF file. Imports no torch.

``gguf.GGUFReader`` builds a numpy view for every string of the vocabulary and
takes seconds to open a file; the tokenizer and the config only need the metadata
section (and, for ``tensor_names``, the tensor directory after it), which this module
parses directly (little-endian GGUF v2/v3) without the ``gguf`` package: the benchmark's
tokenizer and the simulator's model shapes need no engine install. Tensor data is still
read with the ``gguf`` package (see ``gguf_load``).
"""

from __future__ import annotations

import struct
from enum import IntEnum
from functools import lru_cache
from pathlib import Path
from typing import Any


class GGUFValueType(IntEnum):
    """The metadata value types of the GGUF format (the same numbers as ``gguf.GGUFValueType``)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        raw = self.data[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            item_type = GGUFValueType(self.unpack("<I"))
            count = self.unpack("<Q")
            if item_type in _SCALARS:
                fmt = _SCALARS[item_type]
                size = struct.calcsize(fmt)
                items = list(struct.unpack_from(f"<{count}{fmt[1]}", self.data, self.pos))
                self.pos += size * count
                return items
            return [self.value(item_type) for _ in range(count)]
        return self.unpack(_SCALARS[vtype])


def _parse(path: str) -> tuple[_Cursor, int, dict[str, Any]]:
    """The metadata of ``path``, and the cursor and tensor count where the tensor directory starts."""
    size = Path(path).stat().st_size
    data = Path(path).read_bytes() if size < (1 << 20) else _read_header(path)
    cur = _Cursor(data)
    if cur.unpack("<I") != 0x46554747:  # b"GGUF" little-endian
        raise ValueError(
            f"{path} is not a GGUF file (bad magic); give a .gguf file or an HF directory"
        )
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (only v2 and v3)")
    n_tensors = cur.unpack("<Q")
    kv_count = cur.unpack("<Q")
    meta: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string()
        meta[key] = cur.value(GGUFValueType(cur.unpack("<I")))
    return cur, n_tensors, meta


@lru_cache(maxsize=8)
def _read_cached(path: str, size: int, mtime_ns: int) -> dict[str, Any]:
    return _parse(path)[2]


@lru_cache(maxsize=8)
def _tensor_names_cached(path: str, size: int, mtime_ns: int) -> frozenset[str]:
    cur, n_tensors, _ = _parse(path)
    names = set()
    for _ in range(n_tensors):
        names.add(cur.string())
        n_dims = cur.unpack("<I")
        cur.pos += 8 * n_dims + 4 + 8  # the dimensions, the type, the data offset
    return frozenset(names)


def _read_header(path: str) -> bytes:
    """The leading bytes that hold the metadata (the vocabulary makes it a few MB)."""
    chunk = 64 << 20
    with open(path, "rb") as f:
        return f.read(chunk)


def read_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value pairs of a GGUF file (arrays as Python lists). Cached per file version."""
    p = Path(path)
    st = p.stat()
    return _read_cached(str(p.resolve()), st.st_size, st.st_mtime_ns)


def tensor_names(path: str | Path) -> frozenset[str]:
    """The names of a GGUF file's tensors (from its tensor directory; no data is read)."""
    p = Path(path)
    st = p.stat()
    return _tensor_names_cached(str(p.resolve()), st.st_size, st.st_mtime_ns)
