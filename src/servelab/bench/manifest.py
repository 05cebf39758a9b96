"""What a manifest says about the run's setting: versions, the machine, and the command with
its secrets redacted. Shared by `servelab bench` and the simulator's run directories."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shlex
from pathlib import Path
from typing import Any

from servelab import __version__

# Flags whose value is a secret: --api-key, --token and any --*-key / --*-token / --*-secret /
# --*-password (--hf-token); not --tokenizer or --max-num-batched-tokens.
_SECRET_FLAG = re.compile(r"^--(?:[a-z0-9-]*-)?(?:key|token|secret|password)$", re.IGNORECASE)
# NAME=value environment assignments whose name says it holds a secret (HF_TOKEN, OPENAI_API_KEY).
_SECRET_ENV = re.compile(
    r"^([A-Za-z_][A-Za-z0-9_]*(?:KEY|TOKEN|SECRET|PASSWORD)[A-Za-z0-9_]*)=(.+)$", re.IGNORECASE
)
_AUTH = re.compile(r"^(\s*authorization\s*:\s*)(?:(bearer|basic)\s+)?(\S.*)$", re.IGNORECASE)
HIDDEN = "***"


def _scan(argv: list[str]) -> list[tuple[int, str]]:
    """(argument index, secret value) for every secret in ``argv`` (see ``redact``)."""
    found: list[tuple[int, str]] = []
    hide = 0
    for i, a in enumerate(argv):
        if hide:
            if hide == 2 and a.lower() in ("bearer", "basic"):
                hide = 1
                continue
            found.append((i, a))
            hide = 0
            continue
        flag, eq, value = a.partition("=")
        if _SECRET_FLAG.match(flag):
            if eq:
                found.append((i, value))
            else:
                hide = 1
        elif m := _SECRET_ENV.match(a):
            found.append((i, m.group(2)))
        elif m := _AUTH.match(a):
            found.append((i, m.group(3).strip()))
        elif a.strip().lower() == "authorization:":
            hide = 2
    return [(i, v) for i, v in found if v and v != HIDDEN]


def secrets_in(argv: list[str]) -> list[str]:
    """The secret values a command line carries (see ``redact``), longest first."""
    return sorted({v for _, v in _scan(argv)}, key=len, reverse=True)


def redact(argv: list[str]) -> list[str]:
    """The command line with its secrets replaced by ``***``: the value of ``--api-key``,
    ``--token`` and every ``--*-key``/``--*-token``/``--*-secret``/``--*-password`` flag,
    of ``NAME=value`` assignments whose name holds KEY, TOKEN, SECRET or PASSWORD, and of an
    ``Authorization:`` header."""
    out = list(argv)
    for i, v in _scan(argv):
        head, sep, tail = out[i].rpartition(v)
        out[i] = head + HIDDEN + tail if sep else HIDDEN
    return out


def redact_args(args: str) -> str:
    """A flags string with its secrets replaced by ``***`` (``redact``), for manifests;
    unchanged, quoting and all, where it holds none."""
    argv = shlex.split(args or "")
    return shlex.join(redact(argv)) if secrets_in(argv) else args


def hide_secrets(text: str, secrets: list[str]) -> str:
    """``text`` with every occurrence of each of ``secrets`` replaced by ``***`` (for a
    server's log, whose lines may echo its arguments)."""
    for v in secrets:
        text = text.replace(v, HIDDEN)
    return text


def versions() -> dict[str, str]:
    """servelab's, Python's and the client stack's versions."""
    import importlib.metadata as md

    out = {"servelab": __version__, "python": platform.python_version()}
    for pkg in ("aiohttp", "msgspec", "numpy", "uvloop", "tokenizers", "rich", "pydantic"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[pkg] = md.version(pkg)
    return out


def machine() -> dict[str, Any]:
    """The host: platform, CPUs (all, and usable under taskset), CPU model, memory."""
    import psutil

    cpu_model = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu_model,
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
    }
