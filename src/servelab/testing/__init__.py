"""Test doubles that ship with servelab, for its tests and the wheel check.

``testserver`` is a deterministic OpenAI-compatible SSE server (``python -m
servelab.testing.testserver``) driven by ``teststeps``' planted engine steps; ``tokenizers``
builds small real tokenizers in memory from the benchmark corpus. Nothing else in ``servelab``
imports this package.
"""
