"""The simulator's engine settings: ``--engine-args`` and ``--sweep`` of ``servelab sim``.

``--engine-args`` takes `servelab serve`'s flags, read by the one tokenizer
(``servelab.engine_flags``) and checked here against ``EngineConfig``'s fields and the
deployment knobs only a simulation has::

    --max-num-seqs 128 --no-enable-chunked-prefill --kv-cache-memory 40G --tp 2

The old spelling, ``max_num_seqs=128 tp=2`` (spaces or commas between settings), still
reads; ``respell`` gives its new spelling for the command's note.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from servelab.engine.engine_config import EngineConfig
from servelab.engine_flags import RENAMED, Flag, config_key, spell, split_flags
from servelab.units import parse_size_gb

DEPLOYMENT_KEYS = {"tp": int, "gpu_memory_utilization": float}
_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
_KNOWN = {*_FIELDS, *DEPLOYMENT_KEYS, *RENAMED}
_SWITCHES = {name for name, f in _FIELDS.items() if isinstance(f.default, bool)}


def _convert(key: str, value: str | bool) -> Any:
    if isinstance(value, bool):
        return value
    if key in DEPLOYMENT_KEYS:
        return DEPLOYMENT_KEYS[key](value)
    if key == "kv_cache_memory_gb":  # a size, as `servelab serve --kv-cache-memory` takes
        return parse_size_gb(value)
    if key in _SWITCHES:
        v = value.strip().lower()
        if v not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            raise ValueError(f"{key} takes true or false, got {value!r}")
        return v in ("true", "1", "yes", "on")
    if isinstance(_FIELDS[key].default, str):  # a named choice; EngineConfig.validate checks it
        return value.strip()
    if value.strip().lower() in ("none", "auto"):
        return None
    return int(value)


def _settings(text: str | None) -> list[tuple[Flag, str, Any]]:
    out = []
    for flag in split_flags(text, _KNOWN, _SWITCHES):
        key = config_key(flag.name)
        try:
            out.append((flag, key, _convert(key, flag.value)))
        except ValueError as e:
            raise ValueError(f"bad value for engine arg {flag.written!r}: {e}") from None
    return out


def parse_engine_args(text: str | None) -> dict[str, Any]:
    """``{key: value}`` with EngineConfig field names (plus ``tp``, ``gpu_memory_utilization``).

    Raises ValueError naming the bad argument and the known keys.
    """
    return {key: value for _, key, value in _settings(text)}


def respell(text: str | None) -> str | None:
    """``text`` in the flag spelling when it uses the old ``key=value`` one, else None."""
    settings = _settings(text)
    if not any(flag.old_style for flag, _, _ in settings):
        return None
    return " ".join(
        spell(flag.name, value if isinstance(value, bool) else str(flag.value))
        for flag, _, value in settings
    )


def split_deployment(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(EngineConfig fields, deployment knobs)."""
    eng = {k: v for k, v in args.items() if k in _FIELDS}
    dep = {k: v for k, v in args.items() if k in DEPLOYMENT_KEYS}
    return eng, dep


def parse_sweep(texts: list[str]) -> list[dict[str, Any]]:
    """``["max_num_seqs=32,64,128", "enable_chunked_prefill=true,false"]`` -> the grid of points.

    Each text names one key and its values; the grid is their cross product.
    """
    grid: list[dict[str, Any]] = [{}]
    for text in texts:
        if "=" not in text:
            raise ValueError(f"bad --sweep {text!r}: write key=v1,v2,... e.g. max_num_seqs=32,64")
        raw, values = text.split("=", 1)
        points = [
            parse_engine_args(f"{raw.strip()}={v.strip()}") for v in values.split(",") if v.strip()
        ]
        if not points:
            raise ValueError(f"--sweep {text!r} lists no values")
        grid = [{**g, **p} for g in grid for p in points]
    return grid
