"""`servelab import`: other benchmark tools' per-request results as servelab run directories.

One module per format, each with ``looks_like`` (is a parsed file of this format) and
``read`` (the file -> ``imported.Imported``); ``imported.write_imported`` writes every one
of them the same way. ``import_file`` detects the format (or takes the one named) and
writes the run; ``FORMATS`` names what it reads:

- ``guidellm``: GuideLLM's results JSON (first and last token times only);
- ``vllm``: a ``vllm bench serve --save-result --save-detailed`` JSON;
- ``aiperf``: AIPerf's ``profile_export.jsonl`` (``--export-level records``), or the
  artifact directory that holds it;
- ``otel``: vLLM's per-request OpenTelemetry spans as OTLP JSON (the server's own times).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from servelab.bench.imports import aiperf, guidellm, vllm_bench, vllm_otel
from servelab.bench.imports.imported import Imported, UnreadableImport, write_imported

FORMATS: dict[str, Callable[[Path], Imported]] = {
    "guidellm": guidellm.read,
    "vllm": vllm_bench.read,
    "aiperf": aiperf.read,
    "otel": vllm_otel.read,
}

__all__ = ["FORMATS", "UnreadableImport", "detect", "import_file"]


def _source(path: Path) -> Path:
    """The file to read: ``path``, or AIPerf's records file inside an artifact directory."""
    if path.is_dir():
        found = path / aiperf.RECORDS
        if not found.exists():
            raise UnreadableImport(
                f"{path} is a directory without {aiperf.RECORDS}: pass a result file "
                "(GuideLLM's JSON, vllm bench serve's JSON, AIPerf's records file)"
            )
        return found
    if not path.exists():
        raise UnreadableImport(f"no file at {path}")
    return path


def detect(path: Path) -> str:
    """The format of the file at ``path`` (a key of ``FORMATS``); UnreadableImport if none."""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        line = next((ln for ln in text.splitlines() if ln.strip()), "")
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            doc = None
        if aiperf.looks_like(doc):
            return "aiperf"
        if vllm_otel.looks_like(doc):
            return "otel"
    else:
        if guidellm.looks_like(doc):
            return "guidellm"
        if vllm_bench.looks_like(doc):
            return "vllm"
        if aiperf.looks_like(doc):
            return "aiperf"
        if vllm_otel.looks_like(doc):
            return "otel"
    raise UnreadableImport(
        f"{path} is none of the formats servelab imports ({', '.join(FORMATS)}); "
        "name one with --format if it is"
    )


def import_file(
    path: Path,
    out: Path,
    *,
    fmt: str | None = None,
    command: list[str],
    server_config: str | None = None,
) -> tuple[Path, Imported]:
    """Read ``path`` (format ``fmt``, or detected) and write it as a run at ``out``.
    UnreadableImport (a ValueError) with a one-line reason when it cannot."""
    source = _source(path)
    if fmt is not None and fmt not in FORMATS:
        raise UnreadableImport(f"--format {fmt!r}: use {', '.join(FORMATS)}")
    imp = FORMATS[fmt or detect(source)](source)
    return write_imported(imp, source, out, command=command, server_config=server_config), imp
