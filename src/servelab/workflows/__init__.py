"""Workflows: what starts servers and runs benchmarks end to end (the demo, the matrix,
the offline demo). They sit above every library package and below the CLI."""
