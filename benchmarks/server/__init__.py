"""Benchmarks of `servelab serve`: speed over HTTP, an hour of hostile traffic, and
disaggregated against colocated serving."""
