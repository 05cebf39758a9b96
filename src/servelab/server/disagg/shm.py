"""Shared-memory segments for KV transfer on one host (``/dev/shm`` files). No torch.

A segment is a file ``/dev/shm/servelab-kv-<session>-<worker>-<n>``: the sender creates and
fills it, the receiver opens it, unlinks it at once and maps it. The sender also unlinks it
after the transfer timeout (in case the receiver never came), and the router removes every
segment of its session when it stops or a worker dies, so nothing outlives the server.
"""

from __future__ import annotations

import contextlib
import glob
import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "servelab-kv-"


def check_available() -> None:
    """Raise ValueError when this host has no POSIX shared memory directory."""
    if not SHM_DIR.is_dir():
        raise ValueError(
            f"the shm KV transport needs {SHM_DIR} (Linux); use --kv-transport socket instead"
        )


def segment_path(session: str, worker: int, n: int) -> Path:
    return SHM_DIR / f"{PREFIX}{session}-{worker}-{n}"


def remove_session(session: str, worker: int | None = None) -> int:
    """Unlink the session's segments (of one worker, or all); return how many there were."""
    pattern = f"{PREFIX}{session}-{'*' if worker is None else worker}-*"
    removed = 0
    for path in glob.glob(str(SHM_DIR / pattern)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed += 1
    return removed
