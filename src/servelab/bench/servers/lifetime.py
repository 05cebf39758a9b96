"""Launched servers die with the process that launched them, however it ends.

A server runs in a session and process group of its own (so that stopping it reaches every
process it started, as vLLM's engine core), which also means no signal sent to its launcher
reaches it. Four layers, each for what the one before cannot cover:

1. ``stop()`` in ``finally`` blocks: a normal exit, an error, SIGINT (KeyboardInterrupt).
2. SIGTERM and SIGHUP handlers (``timeout``, a CI cancel, ``kill``, a closed terminal),
   installed while a server is up in a process whose handler was the default: they end
   every live server's process group, then let the signal end the process as it would
   have. A signal the process ignores (``nohup``) stays ignored.
3. A parent-death signal: each server is started through ``launch_argv``, which sets
   ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` and then execs the server (Linux; the signal fires
   when the launching *thread* ends, so it is set only for servers started from the main
   thread).
4. A watchdog process (``python -m servelab.bench.servers.lifetime watch``, its own session,
   deaf to SIGINT, SIGTERM and SIGHUP) that the launcher tells of each server's group: when
   the launcher dies, even by SIGKILL or the OOM killer, its pipe closes and the watchdog
   ends every group it was told of (SIGTERM, SIGKILL after the grace).

Each live server is also recorded in a state file (``state_dir()``), removed when it stops;
:func:`stale` finds servers whose launcher is gone but which still run (the watchdog was
killed too), and says how to stop them: each launch warns of them first
(``target.Launched``), and nothing is killed silently.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

GRACE_S = 20.0  # SIGTERM to SIGKILL, as a server's own stop()
_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


class Live(Protocol):
    """What the lifetime machinery needs of a launched server."""

    proc: subprocess.Popen[bytes]
    url: str
    command: list[str]


def launch_argv(argv: list[str]) -> list[str]:
    """``argv`` started through the launcher that sets the parent-death signal (layer 3)."""
    main = threading.current_thread() is threading.main_thread()
    return [
        sys.executable,
        "-m",
        "servelab.bench.servers.lifetime",
        "exec",
        str(os.getpid()),
        "1" if main else "0",
        "--",
        *argv,
    ]


def _exec(parent: int, deathsig: bool, argv: list[str]) -> None:
    if deathsig and sys.platform == "linux":
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the signal was set
            sys.exit(1)
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        print(f"cannot start {argv[0]}: {e}", file=sys.stderr)
        sys.exit(127)


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry))
    return out


def end_groups(pgids: list[int], grace: float = GRACE_S) -> None:
    """SIGTERM to each process group, SIGKILL to what is left of them after ``grace`` s."""
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(group_members(g) for g in pgids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def _watch(parent: int, grace: float) -> None:
    """Layer 4: read ``+PGID`` / ``-PGID`` lines from stdin until it closes or ``parent``
    is no longer this process's parent, then end every group still watched."""
    for sig in (signal.SIGINT, *_SIGNALS):
        signal.signal(sig, signal.SIG_IGN)
    groups: set[int] = set()
    buf = b""
    fd = sys.stdin.fileno()
    while os.getppid() == parent:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line[:1] == b"+":
                groups.add(int(line[1:]))
            elif line[:1] == b"-":
                groups.discard(int(line[1:]))
    end_groups(sorted(groups), grace)


# ----------------------------------------------------------------- the launcher's side

_live: dict[int, Live] = {}  # pgid -> server
_saved: dict[int, Any] = {}  # signal -> the handler it had before ours
_watchdog: subprocess.Popen[bytes] | None = None
_watchdog_fd: int | None = None  # the write end of its pipe


def state_dir() -> Path:
    """Where live servers are recorded: ``$XDG_RUNTIME_DIR/servelab/servers``, else
    ``~/.cache/servelab/servers``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) if runtime else Path.home() / ".cache"
    return base / "servelab" / "servers"


def _started(pid: int) -> float | None:
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _tell(line: str) -> None:
    """A line to the watchdog, started at the first one. Its pipe's write end is a bare
    descriptor (no file object), so a forked child can drop it safely."""
    global _watchdog, _watchdog_fd
    if _watchdog is None or _watchdog.poll() is not None:
        read, write = os.pipe()
        try:
            _watchdog = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "servelab.bench.servers.lifetime",
                    "watch",
                    str(os.getpid()),
                ],
                stdin=read,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            os.close(read)
        if _watchdog_fd is not None:
            with contextlib.suppress(OSError):
                os.close(_watchdog_fd)
        _watchdog_fd = write
        # a new watchdog (the last one died) watches every live server, not only the next
        line = "\n".join([*(f"+{pgid}" for pgid in _live), line])
    with contextlib.suppress(OSError):
        assert _watchdog_fd is not None
        os.write(_watchdog_fd, line.encode() + b"\n")


def register(server: Live) -> None:
    """Layers 2 and 4 and the state file for a server just started (its pid is its group)."""
    pgid = server.proc.pid
    _live[pgid] = server
    _tell(f"+{pgid}")
    if threading.current_thread() is threading.main_thread():
        for sig in _SIGNALS:
            if sig not in _saved and signal.getsignal(sig) is signal.SIG_DFL:
                _saved[sig] = signal.signal(sig, _on_signal)
    with contextlib.suppress(OSError):
        d = state_dir()
        d.mkdir(parents=True, exist_ok=True)
        entry = {
            "pid": pgid,
            "started": _started(pgid),
            "url": server.url,
            "command": server.command,
            "launcher": os.getpid(),
            "launcher_started": _started(os.getpid()),
        }
        (d / f"{pgid}.json").write_text(json.dumps(entry))


def unregister(server: Live) -> None:
    """The server has stopped: forget it everywhere ``register`` recorded it."""
    pgid = server.proc.pid
    if _live.pop(pgid, None) is None:
        return
    _tell(f"-{pgid}")
    with contextlib.suppress(OSError):
        (state_dir() / f"{pgid}.json").unlink()
    if not _live and threading.current_thread() is threading.main_thread():
        for sig, previous in list(_saved.items()):
            if signal.getsignal(sig) is _on_signal:
                signal.signal(sig, previous)
            del _saved[sig]


def _on_signal(signum: int, frame: Any) -> None:
    """Layer 2: end every live server, then die of the signal as without the handler."""
    end_groups(list(_live), GRACE_S)
    for server in list(_live.values()):
        unregister(server)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _forget_in_child() -> None:
    """A forked child owns none of its parent's servers (nor its end of the watchdog's
    pipe, which would keep the watchdog from seeing the parent die)."""
    global _watchdog, _watchdog_fd
    if _watchdog_fd is not None:
        with contextlib.suppress(OSError):
            os.close(_watchdog_fd)
    _watchdog, _watchdog_fd = None, None
    _live.clear()
    _saved.clear()


os.register_at_fork(after_in_child=_forget_in_child)


_reported: set[Path] = set()  # stale records this process has warned of


def stale(new_only: bool = False) -> list[str]:
    """One line per server an earlier servelab launched that still runs while its launcher
    is gone, saying how to stop it (``new_only``: those this process has not reported
    yet). Records of servers that are gone are removed."""
    out = []
    d = state_dir()
    for path in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            entry = json.loads(path.read_text())
            pid, launcher = int(entry["pid"]), int(entry["launcher"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if entry.get("launcher_started") is not None and _started(launcher) == entry.get(
            "launcher_started"
        ):
            continue  # its launcher still runs: not stale, someone's live server
        if entry.get("started") is None or _started(pid) != entry["started"]:
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        if new_only and path in _reported:
            continue
        _reported.add(path)
        command = " ".join(entry.get("command") or [])
        out.append(
            f"a server launched by servelab (pid {launcher}, no longer running) still runs: "
            f"pid {pid} on {entry.get('url')}, `{command}`; it holds its port and memory: "
            f"stop it with `kill -TERM -{pid}` (then remove {path})"
        )
    return out


def main(argv: list[str]) -> None:
    if argv[:1] == ["exec"] and len(argv) > 4 and argv[3] == "--":
        _exec(int(argv[1]), argv[2] == "1", argv[4:])
    elif argv[:1] == ["watch"] and len(argv) == 2:
        _watch(int(argv[1]), GRACE_S)
    else:
        sys.exit(
            "usage: python -m servelab.bench.servers.lifetime exec PPID 0|1 -- ARGV | watch PPID"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
