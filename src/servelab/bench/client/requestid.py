"""The request id every request carries in ``X-Request-Id``, and a server that refuses it.

Every request gets a fresh UUID (``uuid4``), a form every common server takes: vLLM uses it
as its own request id (and echoes it with ``--enable-request-id-headers``), SGLang and
llama.cpp's server accept it, and llama-cpp-python's server, which answers 400 to an id that
is not a UUID, accepts a UUID. A servelab server keys its timelines by it.

Contract: ``RequestIdHeader(enabled)``; ``new_id()`` is the id for the next request (None once
the header is off). A request that carried the header and got a 4xx answer before any such
request succeeded ``should_retry``; the caller sends it again without the header and reports
the retry's status to ``retried``. A retry that succeeds means the server refuses the header:
it is off for the rest of the run and ``refusal`` says so (set once). A retry that fails too
clears the header of blame, as does any success with it; after that nothing is retried.
"""

from __future__ import annotations

import uuid


class RequestIdHeader:
    """Whether requests carry ``X-Request-Id``; see the module contract."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.refusal: str | None = None
        self._cleared = (
            False  # a request with the header succeeded, or its 4xx was not the header's
        )

    def new_id(self) -> str | None:
        return str(uuid.uuid4()) if self.enabled else None

    def answered(self, status: int | None) -> None:
        """A request sent with the header got ``status``."""
        if status is not None and 200 <= status < 300:
            self._cleared = True

    def should_retry(self, status: int | None) -> bool:
        """Whether a 4xx answer to a request sent with the header may be the header's fault."""
        return status is not None and 400 <= status < 500 and not self._cleared

    def retried(self, status: int | None, first_error: str) -> None:
        """The retry without the header got ``status``; the first try failed with
        ``first_error``."""
        if status is None or not 200 <= status < 300:
            if self.refusal is None:
                self._cleared = True
            return
        self.enabled = False
        if self.refusal is None:
            self.refusal = (
                f"the server refused the X-Request-Id header ({first_error}); "
                "the run went on without it, so its records cannot be joined with the "
                "server's own by id"
            )

    def describe(self) -> str:
        """For the manifest: what the run sent."""
        if self.refusal is not None:
            return "refused by the server: sent without it"
        return "a UUID per request" if self.enabled else "off (--no-request-id-header)"
