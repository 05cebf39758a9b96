"""Performance scripts, grouped by the subsystem they measure; run each as
``python -m benchmarks.<group>.<name>`` from the repository root (see README.md here)."""
