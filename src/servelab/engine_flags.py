"""Engine flags: one spelling, one renaming table and one tokenizer for every command.

Engine settings are spelled as `servelab serve` (and vLLM) spells them, wherever they are
given: ``serve --max-num-seqs 8``, ``bench --engine-args "--max-num-seqs 8"``, ``sim
--engine-args "--max-num-seqs 8 --tp 2"``. A few flags name their config key differently
or give it in another unit; ``RENAMED`` maps them, and only it.

``split_flags`` reads such a string. Its callers keep what they each need: the bench
reads a server's flags leniently for its manifest (``read_flags``); the simulator
validates them against the engine's config (``servelab.sim.engine_args``); the server maps its
own flags onto its engine config and the run directory reads an old manifest's flags
(``config_settings``).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from servelab.units import parse_size_gb

# flag (underscored) -> (the config key it sets, how its text becomes that key's value)
RENAMED: dict[str, tuple[str, Callable[[str], Any]]] = {
    "kv_cache_memory": ("kv_cache_memory_gb", parse_size_gb),
    "num_gpu_blocks_override": ("num_kv_blocks", int),
    "tensor_parallel_size": ("tp", int),
}


@dataclass(frozen=True)
class Flag:
    """One setting as written: ``name`` underscored (``max_num_seqs``), ``value`` its text,
    or True / False for a bare ``--x`` / ``--no-x``; ``written`` the name as typed, for
    messages; ``old_style`` when written ``key=value``."""

    name: str
    value: str | bool
    written: str
    old_style: bool = False


def config_key(name: str) -> str:
    """The config key a flag sets: its own name unless ``RENAMED`` says otherwise."""
    return RENAMED[name][0] if name in RENAMED else name


def config_settings(flags: Mapping[str, Any]) -> dict[str, Any]:
    """``flags`` (flag name -> value) under their config keys; a renamed flag's value is
    read from its text by the table (``"512M"`` -> 0.512 GB)."""
    out = dict(flags)
    for name, (key, parse) in RENAMED.items():
        if name in out:
            out[key] = parse(str(out.pop(name)))
    return out


def spell(name: str, value: str | bool) -> str:
    """One setting in the flag spelling: ``--max-num-seqs 8``, ``--x`` or ``--no-x``."""
    flag = name.replace("_", "-")
    if isinstance(value, bool):
        return f"--{flag}" if value else f"--no-{flag}"
    return f"--{flag} {shlex.quote(value)}"


def split_flags(
    text: str | None, known: Collection[str] | None = None, switches: Collection[str] = ()
) -> list[Flag]:
    """The settings in ``text``, in order.

    Given ``known`` (the names it may set) and ``switches`` (those that take no value), the
    text is read strictly: the old spelling (``key=value``, with spaces or commas between
    settings) is read too, and an unknown name or a token that is no setting raises
    ValueError. Without them (a server's own command line, read for the record), a flag
    followed by another flag or by nothing is a switch, and tokens that are no flag are
    skipped.
    """
    if known is None:
        return _lenient(shlex.split(text or ""))
    tokens = [t for part in shlex.split(text or "") for t in part.split(",") if t]
    out: list[Flag] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if "=" in tok:
            raw, value = tok.split("=", 1)
            out.append(Flag(_known(raw, known), value, raw, old_style=not raw.startswith("--")))
        elif not tok.startswith("--"):
            raise ValueError(
                f"cannot read engine arg {tok!r}: write --flag value "
                "(e.g. '--max-num-seqs 128 --no-enable-chunked-prefill')"
            )
        elif (name := _name(tok)).startswith("no_") and name[3:] in switches:
            out.append(Flag(name[3:], False, tok))
        elif _known(tok, known) in switches:
            out.append(Flag(name, True, tok))
        elif i + 1 < len(tokens):
            out.append(Flag(name, tokens[i + 1], tok))
            i += 1
        else:
            raise ValueError(f"engine arg {tok} needs a value")
        i += 1
    return out


def _known(raw: str, known: Collection[str]) -> str:
    name = _name(raw)
    if name not in known:
        raise ValueError(f"unknown engine arg {raw!r}; known: {', '.join(sorted(known))}")
    return name


def _name(raw: str) -> str:
    return raw.lstrip("-").replace("-", "_").strip()


def _lenient(tokens: list[str]) -> list[Flag]:
    out: list[Flag] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.startswith("--"):
            key, eq, val = tok.partition("=")
            name = _name(key)
            if eq:
                out.append(Flag(name, val, key))
            elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                out.append(Flag(name, tokens[i + 1], tok))
                i += 1
            elif name.startswith("no_"):
                out.append(Flag(name[3:], False, tok))
            else:
                out.append(Flag(name, True, tok))
        i += 1
    return out


def read_flags(text: str | None) -> dict[str, Any]:
    """``"--max-num-seqs 8 --no-enable-prefix-caching"`` -> ``{"max_num_seqs": 8,
    "enable_prefix_caching": False}``, read leniently for a record: every flag is kept
    under its own name, unknown ones too; a value is a number or true/false where it
    reads as one, else its text."""
    return {
        f.name: f.value if isinstance(f.value, bool) else _scalar(f.value)
        for f in split_flags(text)
    }


def _scalar(v: str) -> Any:
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)
