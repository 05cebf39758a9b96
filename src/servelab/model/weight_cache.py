"""The dequantised-weight cache: a GGUF file -> an HF directory of fp32 safetensors.

Dequantising the default model takes several seconds; loading fp32 safetensors takes
well under one. The cache lives under ``$SERVELAB_CACHE_DIR`` (default
``~/.cache/servelab``) in ``weights/<gguf stem>-<key>/``, where the key hashes the GGUF's
resolved path, size and mtime, so a changed file gets a new entry. An entry is written
into a temporary directory and renamed into place, so a crash never leaves a partial
entry behind and concurrent loaders do not clash. An entry may also hold arrays derived
from the weights (``cached_arrays``: the q8_0 blocks) in ``derived/``, each file renamed
into place.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

_FORMAT = "1"  # bump when the cached layout changes


def cache_root() -> Path:
    """``$SERVELAB_CACHE_DIR`` or ``~/.cache/servelab``."""
    env = os.environ.get("SERVELAB_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "servelab"


def cache_entry(gguf_path: Path) -> Path:
    """Where the dequantised weights of ``gguf_path`` live (whether or not written yet)."""
    resolved = gguf_path.resolve()
    st = resolved.stat()
    key = hashlib.sha256(f"{resolved}|{st.st_size}|{st.st_mtime_ns}|{_FORMAT}".encode()).hexdigest()
    return cache_root() / "weights" / f"{resolved.stem}-{key[:16]}"


def cached_hf_dir(gguf_path: Path) -> Path:
    """The HF directory holding ``gguf_path``'s dequantised weights; writes it on a miss."""
    from servelab.model.hf_export import export_hf

    entry = cache_entry(gguf_path)
    if (entry / "config.json").is_file() and (entry / "model.safetensors").is_file():
        log.info("loading dequantised weights of %s from cache %s", gguf_path.name, entry)
        return entry
    log.info("dequantising %s to fp32 once; caching it in %s", gguf_path, entry)
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.parent / f".tmp-{entry.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        export_hf(str(gguf_path), tmp)
        try:
            os.rename(tmp, entry)
        except OSError:
            if not (entry / "model.safetensors").is_file():  # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return entry


def cached_arrays(
    gguf_path: Path, name: str, make: Callable[[], dict[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """Arrays derived from ``gguf_path``'s weights (e.g. its q8_0 blocks), kept as
    ``derived/<name>.safetensors`` in its cache entry (a subdirectory: the entry's own
    ``*.safetensors`` are the fp32 checkpoint); ``make()`` computes them on a miss."""
    from safetensors.numpy import load_file, save_file

    entry = cached_hf_dir(gguf_path) / "derived"
    entry.mkdir(exist_ok=True)
    f = entry / f"{name}.safetensors"
    if f.is_file():
        log.info("loading %s weights of %s from cache %s", name, gguf_path.name, f)
        return load_file(str(f))
    arrays = make()
    tmp = entry / f".tmp-{name}-{os.getpid()}.safetensors"
    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp))
    os.replace(tmp, f)  # atomic: a concurrent loader sees the whole file or none
    log.info("cached %s weights of %s in %s", name, gguf_path.name, f)
    return arrays
