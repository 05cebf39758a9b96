"""servelab: see, measure and tune the two phases of LLM inference."""

import os

from servelab.model import kernel_build

# torch's OpenMP pool runs servelab's CPU kernels and torch's own ops; how its idle threads
# wait is read once, when torch loads, hence here. With the kernels, sleeping at once
# (PASSIVE) costs a wake-up per kernel call, while spinning ~30k iterations first keeps the
# threads for the next call. Without them (OpenBLAS fallback), any spinning starves
# OpenBLAS's own threads. Figures in docs/design/model.md. A user's own setting of either
# variable wins.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    if kernel_build.expected():
        os.environ["GOMP_SPINCOUNT"] = "30000"
    else:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

__version__ = "0.1.0"
