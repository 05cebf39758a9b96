"""Parse ``--engine-args`` and ``--sweep`` strings of ``servelab sim``.

Accepted forms, mixed freely and separated by spaces or commas::

    max_num_seqs=128 max-num-batched-tokens=4096
    --max-num-seqs 128 --no-enable-chunked-prefill --enable-prefix-caching
    num_gpu_blocks_override=20000 kv_cache_memory=40G     # vLLM / `servelab serve` names
    tp=2 gpu_memory_utilization=0.85                        # deployment knobs (not EngineConfig)
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Any

from servelab.engine.config import EngineConfig

ALIASES = {
    "num_gpu_blocks_override": "num_kv_blocks",
    "tensor_parallel_size": "tp",
    "kv_cache_memory": "kv_cache_memory_gb",
}
DEPLOYMENT_KEYS = {"tp": int, "gpu_memory_utilization": float}
_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}


def _key(raw: str) -> str:
    k = raw.lstrip("-").replace("-", "_").strip()
    return ALIASES.get(k, k)


def _convert(key: str, value: str) -> Any:
    if key in DEPLOYMENT_KEYS:
        return DEPLOYMENT_KEYS[key](value)
    if key == "kv_cache_memory_gb":
        from servelab.units import parse_size_gb

        return parse_size_gb(value)
    default = _FIELDS[key].default
    if isinstance(default, bool):
        v = value.strip().lower()
        if v not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            raise ValueError(f"{key} takes true or false, got {value!r}")
        return v in ("true", "1", "yes", "on")
    if value.strip().lower() in ("none", "auto"):
        return None
    return float(value) if key == "kv_cache_memory_gb" else int(value)


def _check_key(key: str, raw: str) -> None:
    if key not in _FIELDS and key not in DEPLOYMENT_KEYS:
        known = sorted({*(_FIELDS), *DEPLOYMENT_KEYS})
        raise ValueError(f"unknown engine arg {raw!r}; known: {', '.join(known)}")


def parse_engine_args(text: str | None) -> dict[str, Any]:
    """``{key: value}`` with EngineConfig field names (plus ``tp``, ``gpu_memory_utilization``).

    Raises ValueError naming the bad argument and the known keys.
    """
    out: dict[str, Any] = {}
    if not text:
        return out
    tokens = [t for part in shlex.split(text) for t in part.split(",") if t]
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if "=" in tok:
            raw, value = tok.split("=", 1)
        elif tok.startswith("--"):
            raw = tok
            key = _key(tok)
            if key.startswith("no_") and key[3:] in _FIELDS:
                out[key[3:]] = False
                i += 1
                continue
            _check_key(key, tok)
            if key in _FIELDS and isinstance(_FIELDS[key].default, bool):
                out[key] = True
                i += 1
                continue
            if i + 1 >= len(tokens):
                raise ValueError(f"engine arg {tok} needs a value")
            value = tokens[i + 1]
            i += 1
        else:
            raise ValueError(
                f"cannot read engine arg {tok!r}: write key=value or --flag value "
                "(e.g. 'max_num_seqs=128 --no-enable-chunked-prefill')"
            )
        key = _key(raw)
        _check_key(key, raw)
        try:
            out[key] = _convert(key, value)
        except ValueError as e:
            raise ValueError(f"bad value for engine arg {raw!r}: {e}") from None
        i += 1
    return out


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
