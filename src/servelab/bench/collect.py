"""Server-side data gathered while a benchmark runs, off the measurement's hot path.

- ``TimelineCollector``: for servelab targets, fetches the full timelines of finished
  requests (``GET /v1/timelines?ids=...``, batched) and new engine step records
  (``since_step``) every few seconds, before the server's bounded buffers drop them,
  into ``server.jsonl`` / ``steps.jsonl``. Timelines are keyed by the id the server
  reported in the final chunk (it may have made the client's id unique).
- ``MetricsScraper``: scrapes ``/metrics`` at the start, every ``period`` seconds and at
  the end into ``metrics_scrape.jsonl``, for targets without timelines.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp
import msgspec

from servelab.rundir import RunDir
from servelab.vocab import ClientRecord

_IDS_PER_CALL = 64


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
        sid = (rec.server_timeline or {}).get("request_id") or rec.request_id
        self.pending.append(str(sid))

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
    def __init__(self, url: str, rundir: RunDir, headers: dict[str, str], period: float = 30.0):
        self.url = url
        self.rundir = rundir
        self.headers = headers
        self.period = period
        self.scrapes = 0
        self.available = True
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    async def scrape(self) -> None:
        if not self.available or self._session is None:
            return
        try:
            async with self._session.get(f"{self.url}/metrics") as r:
                if r.status != 200:
                    self.available = False
                    return
                text = await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return
        self.rundir.add_scrape(time.monotonic(), text)
        self.scrapes += 1

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=10), headers=self.headers
        )
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
