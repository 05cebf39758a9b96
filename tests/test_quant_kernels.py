"""servelab's quantised kernels agree with numpy: dequantise (gguf's reference) then matmul."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from servelab.model import cpu_kernels
from servelab.model.linear import linear
from servelab.model.quant import (
    QuantWeight,
    deinterleave,
    f32_rows,
    interleave,
    interleave_bf16,
    interleave_f32,
)

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


def _quantised_inputs(x: np.ndarray) -> np.ndarray:
    """The inputs as the integer-dot kernel sees them: per row and block of 32, rounded to
    127 steps of the block's largest magnitude (llama.cpp's Q8_1)."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float64)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    step = np.where(amax > 0, amax / 127, 0)
    q = np.rint(blocks * np.where(amax > 0, 127 / np.where(amax > 0, amax, 1), 0))
    return (q * step).reshape(x.shape)


int8_dot = pytest.mark.skipif(
    not cpu_kernels.int8_dot_available(), reason="integer dots need AVX512-VNNI"
)


@int8_dot
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize(("n", "k"), [s for s in SHAPES if s[0] % 16 == 0] + [(48, 64)])
def test_interleaved_blocks_match_the_product_of_their_quantised_inputs(
    kind: str, n: int, k: int, threads: int
) -> None:
    """q4_1x16 / q8_0x16: the same bytes reordered (the round trip is exact, dequantising
    gives gguf's values), and the product is that of the dequantised weights with the
    inputs rounded per block of 32, at every row count, tile and token block (to 300 rows)."""
    cpu_kernels.set_num_threads(threads)
    w, ref = _weight(kind, n, k, seed=n + k)
    wx = interleave(w)
    assert wx.kind == kind + "x16" and wx.blocks.numel() == w.blocks.numel()
    assert torch.equal(deinterleave(wx).blocks, w.blocks)
    assert torch.equal(cpu_kernels.dequantize(wx), torch.from_numpy(ref))
    g = torch.Generator().manual_seed(n * k)
    b = torch.randn(n, generator=g)
    for m in (1, 2, 3, 5, 8, 13, 32, 33, 300):
        x = torch.randn(m, k, generator=g)
        x[0, :32] = 0.0  # an all-zero block quantises to zeros, not NaN
        want = _quantised_inputs(x.numpy()) @ ref.T.astype(np.float64)
        _close(linear(x, wx), want.astype(np.float32), k)
        _close(linear(x, wx, b), (want + b.numpy()).astype(np.float32), k)
        res = torch.randn(m, n, generator=g)
        _close(linear(x, wx, residual=res.clone()), (res.numpy() + want).astype(np.float32), k)
        if m in (13, 33):
            # A row's result does not depend on the rows beside it: batching invariance.
            alone = torch.cat([linear(x[i : i + 1], wx) for i in range(m)])
            assert torch.equal(linear(x, wx), alone)


def test_interleaving_refuses_what_it_cannot_reorder() -> None:
    with pytest.raises(ValueError, match="16k rows, not q4_1 x 53"):
        interleave(_weight("q4_1", 53, 96, seed=0)[0])
    with pytest.raises(ValueError, match="not q4_1x16 x 64"):
        interleave(interleave(_weight("q4_1", 64, 96, seed=0)[0]))


@pytest.mark.skipif(
    not cpu_kernels.fp32_interleave_available(), reason="fp32 interleaving needs AVX-512"
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("n", "k"), [s for s in SHAPES if s[0] % 16 == 0] + [(48, 5), (32, 100)])
def test_interleaved_fp32_matches_matmul(n: int, k: int, threads: int) -> None:
    """f32x16: the values reordered (rows read back exactly, one by one or all), and the
    product is x @ w.T at every row count, tile and token block (to 300 rows), with a bias
    or into a residual, each row's result independent of the rows beside it."""
    cpu_kernels.set_num_threads(threads)
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g)
    wx = interleave_f32(w)
    assert wx.kind == "f32x16" and wx.interleaved and wx.n == n and wx.blocks.dtype == w.dtype
    assert torch.equal(f32_rows(wx), w) and torch.equal(cpu_kernels.dequantize(wx), w)
    rows = torch.tensor([n - 1, 0, 17 % n, 17 % n])
    assert torch.equal(f32_rows(wx, rows), w[rows])
    b = torch.randn(n, generator=g)
    ref = w.double().T
    for m in (1, 2, 3, 7, 8, 9, 15, 32, 33, 257, 300):
        x = torch.randn(m, k, generator=g)
        want = (x.double() @ ref).numpy()
        _close(linear(x, wx), want.astype(np.float32), k)
        _close(linear(x, wx, b), (want + b.double().numpy()).astype(np.float32), k)
        res = torch.randn(m, n, generator=g)
        _close(
            linear(x, wx, residual=res.clone()), (res.double().numpy() + want).astype(np.float32), k
        )
        if m in (9, 33, 300):
            alone = torch.cat([linear(x[i : i + 1], wx) for i in range(m)])
            assert torch.equal(linear(x, wx), alone)


def test_fp32_interleaving_needs_rows_in_sixteens() -> None:
    with pytest.raises(ValueError, match="16k rows, not 40"):
        interleave_f32(torch.zeros(40, 8))


def _bf16_plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The bf16 kernel's arithmetic, written out: inputs rounded to bf16 (nearest even), then
    for each pair of columns in order, fp32 sums of the odd column's product, then the even
    one's (VDPBF16PS's order; a bf16 x bf16 product is exact in fp32)."""
    xb, wf = x.to(torch.bfloat16).float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for j in range(0, x.shape[1], 2):
        acc = acc + xb[:, j + 1 : j + 2] * wf[:, j + 1]
        acc = acc + xb[:, j : j + 1] * wf[:, j]
    return acc


@pytest.mark.skipif(not cpu_kernels.bf16_dot_available(), reason="bf16 dots need AVX512-BF16")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("n", "k"), [(576, 576), (64, 1536), (48, 6), (32, 100), (16, 34)])
def test_interleaved_bf16_equals_its_plain_arithmetic(n: int, k: int, threads: int) -> None:
    """bf16x16: the values reordered (rows read back exactly), and the product equals the
    plain arithmetic above bit for bit at every row count, tile and token block (to 300 rows),
    with a bias or into a residual; each row's result is independent of the rows beside it."""
    cpu_kernels.set_num_threads(threads)
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    wx = interleave_bf16(QuantWeight("bf16", w, k))
    assert wx.kind == "bf16x16" and wx.interleaved and wx.n == n and wx.blocks.dtype == w.dtype
    assert torch.equal(f32_rows(wx), w.float()) and torch.equal(
        cpu_kernels.dequantize(wx), w.float()
    )
    rows = torch.tensor([n - 1, 0, 17 % n, 17 % n])
    assert torch.equal(f32_rows(wx, rows), w.float()[rows])
    b = torch.randn(n, generator=g)
    for m in (1, 2, 7, 8, 9, 25, 33, 257, 300) if k < 200 else (1, 9, 33, 257):
        x = torch.randn(m, k, generator=g)
        want = _bf16_plain(x, w)
        assert torch.equal(linear(x, wx), want)
        assert torch.equal(linear(x, wx, b), want + b)
        res = torch.randn(m, n, generator=g)
        assert torch.equal(linear(x, wx, residual=res.clone()), res + want)
        if m in (9, 33):
            alone = torch.cat([linear(x[i : i + 1], wx) for i in range(m)])
            assert torch.equal(linear(x, wx), alone)


def test_bf16_interleaving_needs_rows_in_sixteens_and_even_columns() -> None:
    with pytest.raises(ValueError, match="16k rows and even columns, not bf16 40 x 8"):
        interleave_bf16(QuantWeight("bf16", torch.zeros(40, 8, dtype=torch.bfloat16), 8))
    with pytest.raises(ValueError, match="not bf16 32 x 7"):
        interleave_bf16(QuantWeight("bf16", torch.zeros(32, 7, dtype=torch.bfloat16), 7))
