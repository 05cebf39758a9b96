"""glibc heap controls shared by the server's processes (None where libc lacks them).

glibc keeps freed heap pages mapped, and after its first big free it raises its mmap
threshold, so later big buffers come from the heap too. A process that frees many buffers
of changing sizes (big request bodies in the API and its workers, prefill activations and
oneDNN primitives of new shapes in the engine core) therefore grows without leaking.
``MALLOC_TRIM(0)`` hands the free pages back; ``MALLOPT(M_MMAP_THRESHOLD, n)`` fixes the
threshold so that every buffer of ``n`` bytes or more gets its own mapping.

``keep_step_buffers()`` is the engine core's policy: within a step the heap keeps what it
frees, and the core's periodic ``MALLOC_TRIM(0)`` after work hands it back.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
# glibc's ceiling for a fixed mmap threshold on 64-bit; a 2,048-token prefill's largest
# activation (SmolLM2's gate/up output) is 25 MB.
STEP_MMAP_BYTES = 32 * 2**20
STEP_TRIM_BYTES = 512 * 2**20


def _libc(name: str) -> Any:
    try:
        return getattr(ctypes.CDLL(None), name)  # glibc; absent elsewhere
    except (OSError, AttributeError):
        return None


MALLOC_TRIM: Callable[[int], int] | None = _libc("malloc_trim")
MALLOPT: Callable[[int, int], int] | None = _libc("mallopt")


def keep_step_buffers() -> None:
    """Fix glibc's thresholds for a process that runs engine steps: buffers under
    ``STEP_MMAP_BYTES`` come from the heap, and free() shrinks the heap only past
    ``STEP_TRIM_BYTES`` of free top.

    Why: glibc's own thresholds follow the biggest buffer freed (trim at twice it), while a
    layer frees several such buffers at once, so a long prefill shrank the heap and grew it
    again, faulting in zeroed pages, layer after layer: a 2,048-token prefill ran at 711-721
    tok/s against 879-887 with these thresholds (one thread, same process state). The core
    still hands the pages back after work (``MALLOC_TRIM``), so memory stays bounded.
    """
    if MALLOPT is not None:
        MALLOPT(M_MMAP_THRESHOLD, STEP_MMAP_BYTES)
        MALLOPT(M_TRIM_THRESHOLD, STEP_TRIM_BYTES)
