"""glibc heap controls shared by the server's processes (None where libc lacks them).

glibc keeps freed heap pages mapped, and after its first big free it raises its mmap
threshold, so later big buffers come from the heap too. A process that frees many buffers
of changing sizes (big request bodies in the API and its workers, prefill activations and
oneDNN primitives of new shapes in the engine core) therefore grows without leaking.
``MALLOC_TRIM(0)`` hands the free pages back; ``MALLOPT(M_MMAP_THRESHOLD, n)`` fixes the
threshold so that every buffer of ``n`` bytes or more gets its own mapping.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def _libc(name: str) -> Any:
    try:
        return getattr(ctypes.CDLL(None), name)  # glibc; absent elsewhere
    except (OSError, AttributeError):
        return None


MALLOC_TRIM: Callable[[int], int] | None = _libc("malloc_trim")
MALLOPT: Callable[[int, int], int] | None = _libc("mallopt")
