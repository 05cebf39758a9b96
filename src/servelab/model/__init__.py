"""The torch model runtime: weights, kernels and the executor (see docs/design/model.md).

The light description of a model (catalogue, config, tokenizer, GGUF metadata) is
``servelab.modelcore``; this package holds what needs torch or the compiled kernels. Entry
points: ``loader.load_model``, ``torch_runner.TorchModelRunner``, ``build.build_engine``.

Importing it first sets how idle OpenMP threads wait, which torch reads once when it loads.
With servelab's kernels, sleeping at once (PASSIVE) costs a wake-up per kernel call, while
spinning ~30k iterations first keeps the threads for the next call. Without them (OpenBLAS
fallback), any spinning starves OpenBLAS's own threads. Figures in docs/design/model.md. A
user's own setting of either variable wins. Every module here that imports torch does so
below this package, so the policy is in place first.
"""

import os

from servelab.model import kernel_build

if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    if kernel_build.expected():
        os.environ["GOMP_SPINCOUNT"] = "30000"
    else:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
