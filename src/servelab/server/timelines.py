"""Recent request timelines and step records, bounded in memory (served by /v1/timelines)."""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any


class TimelineStore:
    """The last ``max_timelines`` finished timelines and ``max_steps`` step records.

    Both are kept as the dicts of ``RequestTimeline.to_dict()`` / ``StepRecord.to_dict()``;
    the oldest entries are dropped first.
    """

    def __init__(self, max_timelines: int = 2048, max_steps: int = 8192) -> None:
        self._timelines: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._steps: deque[dict[str, Any]] = deque(maxlen=max_steps)
        self._max_timelines = max_timelines

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._timelines

    def add_timeline(self, timeline: dict[str, Any]) -> None:
        self._timelines[timeline["request_id"]] = timeline
        self._timelines.move_to_end(timeline["request_id"])
        while len(self._timelines) > self._max_timelines:
            self._timelines.popitem(last=False)

    def add_step(self, record: dict[str, Any]) -> None:
        self._steps.append(record)

    def query(self, ids: list[str] | None = None, since_step: int | None = None) -> dict[str, Any]:
        """Timelines (all, or those of ``ids`` that are still held) and steps after ``since_step``.

        ``since_step`` is exclusive, so a poller passes the last step id it has seen.
        """
        if ids is None:
            timelines = list(self._timelines.values())
        else:
            timelines = [self._timelines[i] for i in ids if i in self._timelines]
        steps = list(self._steps)
        if since_step is not None:
            steps = [s for s in steps if s["step_id"] > since_step]
        return {"timelines": timelines, "steps": steps}
