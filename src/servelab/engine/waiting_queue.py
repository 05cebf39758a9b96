"""The scheduler's waiting queue: priority classes, first come first served within each."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from servelab.engine.request import Request


class WaitingQueue:
    """Waiting requests by priority class (lower value first), first come first served
    within a class; a preempted request goes back to the front of its class
    (``push_front``). ``peek`` and ``pop`` give the next request to admit (the queue must
    not be empty), ``remove`` takes one out from anywhere (False if it is not queued), and
    iteration runs in admission order."""

    def __init__(self) -> None:
        self._classes: dict[int, deque[Request]] = {}
        self._len = 0

    def push_back(self, req: Request) -> None:
        self._classes.setdefault(req.priority, deque()).append(req)
        self._len += 1

    def push_front(self, req: Request) -> None:
        self._classes.setdefault(req.priority, deque()).appendleft(req)
        self._len += 1

    def peek(self) -> Request:
        return self._classes[min(self._classes)][0]

    def pop(self) -> Request:
        prio = min(self._classes)
        q = self._classes[prio]
        req = q.popleft()
        if not q:
            del self._classes[prio]
        self._len -= 1
        return req

    def remove(self, req: Request) -> bool:
        q = self._classes.get(req.priority)
        if q is None or req not in q:
            return False
        q.remove(req)
        if not q:
            del self._classes[req.priority]
        self._len -= 1
        return True

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        for prio in sorted(self._classes):
            yield from self._classes[prio]
