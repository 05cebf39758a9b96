"""servelab: see, measure and tune the two phases of LLM inference."""

import os

# Decode routes matrix-vector products through OpenBLAS while torch runs the other ops on
# its OpenMP pool. With OpenMP's default spin-waiting, torch's idle threads hold the cores
# that OpenBLAS's threads need: a SmolLM2 decode step at 2 threads measured 270 ms spinning
# vs 45 ms passive (1 thread: 62 ms). It must be set before torch loads, hence here.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
