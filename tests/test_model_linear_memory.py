"""The prefill products' kernel caches stay bounded however many prompt lengths a server sees."""

import subprocess
import sys

import pytest

from servelab.model import linear

# In a fresh process (the caches are process-wide and read their size once): products of
# 300 row counts, RSS taken after the first 100 and at the end.
_PROBE = """
import psutil, torch
torch.set_num_threads(1)
from servelab.model.linear import linear
w, w2 = torch.randn(1536, 576), torch.randn(576, 1536)
rss = []
for m in range(33, 333):
    y = linear(torch.randn(m, 576), w)
    linear(y, w2, residual=torch.randn(m, 576))
    if m in (133, 332):
        rss.append(psutil.Process().memory_info().rss)
print(rss[1] - rss[0])
"""


@pytest.mark.skipif(not linear._ONEDNN, reason="the oneDNN route is not taken without oneDNN")
def test_rss_stays_flat_over_new_prompt_lengths() -> None:
    # With oneDNN's and ideep's default 1024-entry caches this grows ~1 MB per row count
    # (hundreds of MB here); bounded, the last 200 lengths add a few MB.
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True)
    growth_mb = int(out.stdout) / 2**20
    assert growth_mb < 64, growth_mb
