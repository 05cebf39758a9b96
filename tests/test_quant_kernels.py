"""servelab's quantised kernels agree with numpy: dequantise (gguf's reference) then matmul."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from servelab.model import cpu_kernels
from servelab.model.linear import linear
from servelab.model.quant import QuantWeight

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels not built here")

KINDS = {"q8_0": GGMLQuantizationType.Q8_0, "q4_1": GGMLQuantizationType.Q4_1}
# (n, k): SmolLM2's q and k/v projections (GQA: 3 KV heads of 64), o, gate/up and down,
# and small odd row counts.
SHAPES = [(576, 576), (192, 576), (64, 576), (3072, 576), (576, 1536), (53, 96), (7, 32)]


def _weight(kind: str, n: int, k: int, seed: int) -> tuple[QuantWeight, np.ndarray]:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    blocks = gguf_quantize(w, KINDS[kind])
    ref = gguf_dequantize(blocks, KINDS[kind]).astype(np.float32).reshape(n, k)
    return QuantWeight(kind, torch.from_numpy(blocks), k), ref


def _close(got: torch.Tensor, want: np.ndarray, k: int) -> None:
    torch.testing.assert_close(got, torch.from_numpy(want), rtol=1e-4, atol=1e-5 * k)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_qlinear_matches_dequantised_matmul(kind: str, n: int, k: int, threads: int) -> None:
    cpu_kernels.set_num_threads(threads)
    w, ref = _weight(kind, n, k, seed=n + k)
    g = torch.Generator().manual_seed(n * k)
    b = torch.randn(n, generator=g)
    for m in (1, 2, 3, 4, 5, 7, 8, 11, 12, 13, 16, 17, 31, 32):
        x = torch.randn(m, k, generator=g)
        _close(cpu_kernels.qlinear(x, w), x.numpy() @ ref.T, k)
        _close(cpu_kernels.qlinear(x, w, b), x.numpy() @ ref.T + b.numpy(), k)
        res = torch.randn(m, n, generator=g)
        want = res.numpy() + x.numpy() @ ref.T
        _close(cpu_kernels.qlinear(x, w, residual=res.clone()), want, k)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_dequantize_and_many_rows(kind: str, threads: int) -> None:
    """Above MAX_ROWS ``linear`` dequantises (exactly gguf's values) and runs a GEMM."""
    cpu_kernels.set_num_threads(threads)
    w, ref = _weight(kind, 192, 576, seed=3)
    assert torch.equal(cpu_kernels.dequantize(w), torch.from_numpy(ref))
    g = torch.Generator().manual_seed(5)
    for m in (33, 40, 257):
        x = torch.randn(m, 576, generator=g)
        _close(linear(x, w), x.numpy() @ ref.T, 576)


def test_scattered_rows_of_blocks() -> None:
    """Rows permuted and concatenated as whole rows of blocks (the fused qkv weight) give
    the same permutation of the product."""
    wa, ra = _weight("q4_1", 64, 576, seed=1)
    wb, rb = _weight("q4_1", 32, 576, seed=2)
    perm = torch.randperm(96, generator=torch.Generator().manual_seed(0))
    fused = QuantWeight("q4_1", torch.cat([wa.blocks, wb.blocks])[perm].contiguous(), 576)
    x = torch.randn(3, 576)
    _close(cpu_kernels.qlinear(x, fused), x.numpy() @ np.concatenate([ra, rb])[perm.numpy()].T, 576)
