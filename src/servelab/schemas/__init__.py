"""The JSON Schemas of a run directory's files, shipped with the package.

``metrics.v1.schema.json`` (``metrics.json``), ``manifest.v1.schema.json`` (``manifest.json``)
and ``request.v1.schema.json`` (one line of ``requests.jsonl``), JSON Schema 2020-12. The
major version is in the file name and the ``$id``; a change that removes or retypes a key
makes a new version, added keys do not. ``schema(name)`` reads one (``"metrics"``,
``"manifest"``, ``"request"``); ``path(name)`` says where it lies, for validators that take
a file.
"""

from __future__ import annotations

import json
from functools import cache
from importlib.resources import files
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
NAMES = ("metrics", "manifest", "request")


def path(name: str) -> Path:
    """The installed file of schema ``name``."""
    if name not in NAMES:
        raise ValueError(f"no schema {name!r}: known are {', '.join(NAMES)}")
    return Path(str(files("servelab.schemas") / f"{name}.v{SCHEMA_VERSION}.schema.json"))


@cache
def schema(name: str) -> dict[str, Any]:
    """Schema ``name`` as a dict."""
    data: dict[str, Any] = json.loads(path(name).read_text())
    return data
