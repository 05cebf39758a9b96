"""The live progress line and the end-of-run summary table (rich).

The display is redrawn from the event loop twice a second (not from rich's own
thread, which would take the GIL at moments the loop cannot see); its cost shows up
in the client's measured loop lag like any other work.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque

from rich.console import Console
from rich.live import Live
from rich.text import Text

from servelab.vocab import ClientRecord

_REFRESH_S = 0.5
_RATE_WINDOW_S = 10.0


class Progress:
    """Counts sends and completions; ``run()`` keeps a live line on screen."""

    def __init__(self, console: Console, label: str, total: int | None, quiet: bool = False):
        self.console = console
        self.label = label
        self.total = total
        self.quiet = quiet
        self.sent = 0
        self.done = 0
        self.errors = 0
        self._recent: deque[float] = deque()
        self._ttfts: deque[float] = deque(maxlen=200)
        self._t0 = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self._live: Live | None = None

    def on_send(self) -> None:
        self.sent += 1

    def on_record(self, rec: ClientRecord) -> None:
        if rec.error is not None and rec.error.startswith("skipped"):
            self.sent += 1  # never sent, but done: keep "in flight" = sent - done right
        self.done += 1
        if not rec.ok:
            self.errors += 1
        now = time.monotonic()
        self._recent.append(now)
        if rec.ttft is not None:
            self._ttfts.append(rec.ttft)

    def line(self) -> Text:
        now = time.monotonic()
        while self._recent and self._recent[0] < now - _RATE_WINDOW_S:
            self._recent.popleft()
        span = min(_RATE_WINDOW_S, max(1e-3, now - self._t0))
        ttft = sorted(self._ttfts)[len(self._ttfts) // 2] if self._ttfts else None
        total = f"/{self.total}" if self.total else ""
        t = Text()
        t.append(f"{self.label} ", style="bold")
        t.append(f"{now - self._t0:6.1f}s  done {self.done}{total}  ")
        t.append(f"in flight {self.sent - self.done}  ")
        t.append(f"errors {self.errors}  ", style="red" if self.errors else "")
        t.append(f"rate {len(self._recent) / span:.2f} req/s  ")
        t.append(f"TTFT p50 {ttft * 1e3:.0f} ms" if ttft is not None else "TTFT p50 -")
        return t

    async def _refresh(self) -> None:
        assert self._live is not None
        while True:
            await asyncio.sleep(_REFRESH_S)
            self._live.update(self.line(), refresh=True)

    def start(self) -> None:
        self._t0 = time.monotonic()
        if self.quiet:
            return
        self._live = Live(self.line(), console=self.console, auto_refresh=False, transient=False)
        self._live.start()
        self._task = asyncio.get_running_loop().create_task(self._refresh())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._live is not None:
            self._live.update(self.line(), refresh=True)
            self._live.stop()
            if not self.console.is_terminal:  # rich ends the line only on a terminal
                self.console.line()
