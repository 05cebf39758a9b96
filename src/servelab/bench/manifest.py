"""What a manifest says about the run's setting: versions, the machine, and the command with
its secrets redacted. Shared by `servelab bench` and the simulator's run directories."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path
from typing import Any

from servelab import __version__


def redact(argv: list[str]) -> list[str]:
    """The command line with the value of ``--api-key`` replaced by ``***``."""
    out, hide = [], False
    for a in argv:
        if hide:
            out.append("***")
            hide = False
        elif a == "--api-key":
            out.append(a)
            hide = True
        elif a.startswith("--api-key="):
            out.append("--api-key=***")
        else:
            out.append(a)
    return out


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
