"""Benchmarks of the simulator: its speed, its fidelity against real runs on this machine and
against published GPU figures."""
