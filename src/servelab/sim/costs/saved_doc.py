"""The versioned JSON files the cost models are read back from (profile tables,
calibrations): a ``format`` field names the kind and its version."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def save_doc(path: str | Path, fmt: str, body: dict[str, Any]) -> Path:
    """Write ``body`` under ``"format": fmt`` to ``path`` (its folder made); return the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"format": fmt, **body}, indent=1))
    return p


def load_doc(path: str | Path, fmt: str, what: str, make: str) -> dict[str, Any]:
    """The document at ``path``, format field included. Raises ValueError where there is no
    file (saying how to ``make`` one) or its format is not ``fmt``; ``what`` names the kind."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"no {what} at {p}; {make}")
    doc = json.loads(p.read_text())
    if doc.get("format") != fmt:
        raise ValueError(f"{p} is not a servelab {what} ({fmt})")
    return doc
