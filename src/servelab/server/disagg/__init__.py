"""Disaggregated prefill/decode serving: ``servelab serve --disaggregated``.

``router.DisaggClient`` (API process) routes requests to prefill and decode worker
processes (``worker``), each an engine core over a ``engine.DisaggEngine``; KV blocks move
between them through a ``transport`` (shared memory or TCP). See docs/design/disagg.md.
"""
