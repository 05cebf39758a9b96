"""Kernel receive stamps on Linux TCP sockets.

With ``SO_TIMESTAMPNS`` (not exported by Python's socket module) every ``recvmsg`` also returns
when the kernel received the data it read: a time no delay in the reading process can move.

Contract: ``stamp_receives(sock)`` asks for them and says whether the platform gives them;
``recv_stamped(sock, size)`` reads like ``sock.recv`` (raising what it raises) and returns the
bytes, the monotonic time of the read, and the kernel's receive time on the monotonic clock
(None where the read carried none). The kernel stamps CLOCK_REALTIME; the conversion takes the
two clocks' offset at the read, so only a step of the wall clock between a segment's arrival and
its read could misplace it. A read spanning several segments carries the last one's time.
"""

from __future__ import annotations

import socket
import struct
import sys
import time

_SO_TIMESTAMPNS = 35
_ANC_SIZE = socket.CMSG_SPACE(16) if hasattr(socket, "CMSG_SPACE") else 0


def stamp_receives(sock: socket.socket) -> bool:
    """Ask the kernel for receive stamps on ``sock``; False where the platform has none."""
    if not _ANC_SIZE or not sys.platform.startswith("linux"):
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    return True


def recv_stamped(sock: socket.socket, size: int) -> tuple[bytes, float, float | None]:
    """Up to ``size`` bytes, when they were read and when the kernel received them."""
    data, anc, _, _ = sock.recvmsg(size, _ANC_SIZE)
    real, now = time.time(), time.monotonic()
    kernel = None
    for level, kind, raw in anc:
        if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(raw) >= 16:
            sec, nsec = struct.unpack_from("qq", raw)
            kernel = sec + nsec * 1e-9 - (real - now)
    return data, now, kernel
