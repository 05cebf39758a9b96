"""Benchmarks of the analysis: the diagnosis against planted causes, the demo verdicts' power."""
