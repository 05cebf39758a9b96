"""Server-side data gathered while a benchmark runs, off the measurement's hot path.

- ``TimelineCollector``: for servelab targets, fetches the full timelines of finished
  requests (``GET /v1/timelines?ids=...``, batched) and new engine step records
  (``since_step``) every few seconds, before the server's bounded buffers drop them,
  into ``server.jsonl`` / ``steps.jsonl``. Timelines are keyed by the id the server
  reported in the final chunk (it may have made the client's id unique).
- ``MetricsScraper``: scrapes ``/metrics`` at the start, every ``period`` seconds (0.5 s
  by default) and at the end into ``metrics_scrape.jsonl``: the server's queue, running
  count, KV usage and counters as a time series (``analyze/server_side/timeseries.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from servelab.rundir import RunDir, server_id
from servelab.vocab import ClientRecord

_IDS_PER_CALL = 64
SCRAPE_INTERVAL = 0.5  # seconds between /metrics scrapes (``--scrape-interval``)


class _Reply(msgspec.Struct):
    """``/v1/timelines``: the timelines stay undecoded, since they go to ``server.jsonl``
    as sent (decoding and re-encoding every token time was the collector's main cost)."""

    timelines: list[msgspec.Raw] = []
    steps: list[dict[str, Any]] = []


_decode_reply = msgspec.json.Decoder(_Reply).decode


class TimelineCollector:
    def __init__(self, url: str, rundir: RunDir, headers: dict[str, str], period: float = 5.0):
        self.url = url
        self.rundir = rundir
        self.headers = headers
        self.period = period
        self.pending: list[str] = []
        self.fetched = 0
        self.missing = 0
        self.steps = 0
        self._last_step: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self.error: str | None = None

    def finished(self, rec: ClientRecord) -> None:
        """Queue a finished request's timeline for fetching."""
        self.pending.append(server_id(rec))

    def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=30), headers=self.headers
        )
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            await self.poll()

    async def poll(self) -> None:
        """Fetch queued timelines and new steps now (errors are kept, not raised)."""
        if self._session is None:
            return
        try:
            while self.pending:
                batch, self.pending = self.pending[:_IDS_PER_CALL], self.pending[_IDS_PER_CALL:]
                reply = await self._get(self._params(",".join(batch)))
                for raw in reply.timelines:
                    self.rundir.add_timeline_json(raw)
                self.fetched += len(reply.timelines)
                self.missing += len(batch) - len(reply.timelines)
                self._add_steps(reply.steps)
            self._add_steps((await self._get(self._params(""))).steps)
        except (aiohttp.ClientError, asyncio.TimeoutError, msgspec.DecodeError) as e:
            self.error = f"fetching timelines failed: {e}"

    def _params(self, ids: str) -> dict[str, str]:
        # Always bound the step records asked for: without since_step the server
        # returns its whole step history on every call.
        params = {"ids": ids}
        if self._last_step is not None:
            params["since_step"] = str(self._last_step)
        return params

    def _add_steps(self, steps: list[dict[str, Any]]) -> None:
        for s in steps:
            sid = s.get("step_id")
            if self._last_step is not None and sid is not None and sid <= self._last_step:
                continue
            self.rundir.add_step(s)
            self.steps += 1
            if sid is not None:
                self._last_step = sid if self._last_step is None else max(self._last_step, sid)

    async def _get(self, params: dict[str, str]) -> _Reply:
        assert self._session is not None
        async with self._session.get(f"{self.url}/v1/timelines", params=params) as r:
            r.raise_for_status()
            return _decode_reply(await r.read())

    async def stop(self) -> None:
        """Stop polling, then fetch whatever is still queued."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.poll()
        if self._session is not None:
            await self._session.close()

    def report(self) -> dict[str, Any]:
        return {
            "timelines": self.fetched,
            "timelines_missing": self.missing,
            "steps": self.steps,
            "error": self.error,
        }


class MetricsScraper:
    """``/metrics`` as a time series: one scrape every ``period`` seconds, off the hot path.

    Bounded cost: scrapes run one at a time (a slow one delays the next, never stacks),
    each with a timeout of ``max(1 s, 2 x period)``; a scrape slower than that, or slower
    than half the period, doubles the period (up to ``MAX_PERIOD``). The first answer is
    parsed once to check it is Prometheus text; later ones are stored as they came. A
    missing (non-200), malformed or slow ``/metrics`` is noted once in ``note`` and the run
    goes on; what it cost the client is in ``report()``.
    """

    MAX_PERIOD = 8.0

    def __init__(
        self,
        url: str,
        rundir: RunDir,
        headers: dict[str, str],
        period: float = SCRAPE_INTERVAL,
    ):
        self.url = url
        self.rundir = rundir
        self.headers = headers
        self.period = period
        self.requested_period = period
        self.scrapes = 0
        self.available = True
        self.note: str | None = None
        self.seconds = 0.0  # wall time spent waiting for and storing scrapes
        self.bytes = 0
        self._checked = False
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def _noted(self, what: str) -> None:
        if self.note is None:
            self.note = what

    async def scrape(self) -> None:
        if not self.available or self._session is None:
            return
        t0 = time.monotonic()
        try:
            timeout = aiohttp.ClientTimeout(total=self._timeout)
            async with self._session.get(f"{self.url}/metrics", timeout=timeout) as r:
                if r.status != 200:
                    self.available = False
                    self._noted(f"/metrics answered HTTP {r.status}: no server time series")
                    return
                text = await r.text()
        except asyncio.TimeoutError:
            self._slower(f"/metrics took over {self._timeout:g} s")
            return
        except aiohttp.ClientError as e:
            self._noted(f"/metrics failed: {e}")
            return
        finally:
            self.seconds += time.monotonic() - t0
        if not self._checked:
            self._checked = True
            if not _is_prometheus(text):
                self.available = False
                self._noted("/metrics is not Prometheus text: no server time series")
                return
        took = time.monotonic() - t0
        self.rundir.add_scrape(time.monotonic(), text)
        self.scrapes += 1
        self.bytes += len(text)
        if took > 0.5 * self.period:
            self._slower(f"/metrics took {took:.2f} s")

    def _slower(self, why: str) -> None:
        if self.period < self.MAX_PERIOD:
            self.period = min(self.MAX_PERIOD, self.period * 2)
        self._noted(f"{why}; scraping every {self.period:g} s instead")

    @property
    def _timeout(self) -> float:
        return max(1.0, 2 * self.period)

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(headers=self.headers)
        await self.scrape()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while self.available:
            await asyncio.sleep(self.period)
            await self.scrape()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.scrape()
        if self._session is not None:
            await self._session.close()

    def report(self, wall_seconds: float) -> dict[str, Any]:
        """What scraping cost and gave, for the stage's self-check in the manifest."""
        return {
            "scrapes": self.scrapes,
            "interval_s": self.requested_period,
            "final_interval_s": self.period,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 4),
            "share_of_wall": round(self.seconds / wall_seconds, 4) if wall_seconds > 0 else None,
            "note": self.note,
        }


def _is_prometheus(text: str) -> bool:
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError):
        return False
    return bool(families)
