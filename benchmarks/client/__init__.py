"""Benchmarks of the benchmark client: its timing error, beside the peer clients, and where one
client process stops being enough."""
