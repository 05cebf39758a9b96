"""servelab's own CPU kernels for decode-shaped work (``csrc/cpu_kernels.c``), via ctypes.

Contract:
- ``available()`` is True when the kernels are built and loaded: an x86-64 CPU with AVX2,
  FMA and F16C, a C compiler (``$CC`` or ``cc``) with OpenMP, and ``SERVELAB_CPU_KERNELS`` not
  set to ``0``. ``kernel_build`` compiles the library once per source version into
  ``$SERVELAB_CACHE_DIR/kernels`` (default ``~/.cache/servelab/kernels``); a failed build
  is reported once as a warning and the callers fall back to numpy/torch.
- ``linear(x, w, b, residual)``: ``x @ w.T + b`` for fp32 CPU tensors, ``x`` [m, k] and
  ``w`` [n, k] contiguous, added into ``residual`` in place when given; meant for the few
  rows of decode (``MAX_ROWS``).
- ``qlinear(x, w, b, residual)``: the same product with ``w`` a ``quant.QuantWeight``
  (GGUF Q8_0 or Q4_1 blocks, dequantised in registers for a few rows, a 24-row panel at a
  time into an L2 tile from 12 rows on; kinds ``q4_1x16`` and ``q8_0x16`` by integer dots on
  inputs rounded to 8 bits per block of 32, any row count, where ``int8_dot_available()``;
  kind ``f32x16``, fp32 interleaved by 16 rows, at any row count where
  ``fp32_interleave_available()``; kind ``bf16x16``, bf16 interleaved by 16 rows, by
  AVX512-BF16 dot products on inputs rounded to bf16, fp32 sums, at any row count where
  ``bf16_dot_available()``); ``dequantize(w)`` its fp32 matrix.
- ``paged_attention(...)``: causal attention of a few query tokens per sequence over K/V
  read in place from the paged cache (no gather); see its docstring.
  ``paged_attention(..., prefill=True)``: the same for prefill chunks, 32 tokens a tile
  (AVX-512 builds only: ``prefill_attention_available()``).
- ``rms_norm``, ``silu_mul``, ``rope_store``: the per-token glue of a decoder layer, one
  call each (see ``servelab.model.ops``, which picks them or the torch equivalents).
- ``decoder_stack(...)``: every decoder layer of a few-token batch whose attention is all
  on the paged kernel, in one call (``LlamaForCausalLM`` uses it for decode steps).
- ``set_num_threads(n)`` sets the kernels' thread count (the runner's count). The library
  links ``libgomp.so.1``, which resolves to the copy torch already loaded, so the kernels
  and torch's ops share one OpenMP thread pool.

Why: see the C file's header. Numerics: fp32 throughout, sums in a different order than
BLAS, so results agree with the torch path to float rounding, not bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import warnings

import torch

from servelab.model import kernel_build
from servelab.model.quant import QuantWeight, f32_rows

MAX_ROWS = 32  # above this, prefill-sized products go to BLAS, which tiles for cache

enabled = True  # benchmarks flip this to compare against BLAS and torch
_lib: ctypes.CDLL | None = None
_tried = False
_threads = 1


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if not kernel_build.wanted():
        return None
    try:
        lib = ctypes.CDLL(str(kernel_build.build()))
    except (OSError, RuntimeError) as e:
        warnings.warn(
            f"servelab CPU kernels unavailable ({e}); decode falls back to BLAS and torch",
            stacklevel=2,
        )
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.sl_linear.argtypes = [p, p, p, p, i64, i64, i64, i32, i32]
    lib.sl_linear.restype = None
    lib.sl_qlinear.argtypes = [p, p, p, p, i64, i64, i64, i32, i32, i32]
    lib.sl_dequantize.argtypes = [p, p, i64, i64, i32, i32]
    lib.sl_int8_dot.argtypes = []
    lib.sl_f32_interleaved.argtypes = []
    lib.sl_bf16_dot.argtypes = []
    lib.sl_paged_attention.argtypes = [p, i64, p, p, p, i64, p, p, p, i64, p]
    lib.sl_paged_attention.argtypes += [i64, i64, i64, i64, ctypes.c_float, i32]
    lib.sl_paged_attention.restype = None
    lib.sl_prefill_attention.argtypes = lib.sl_paged_attention.argtypes
    lib.sl_prefill_attention.restype = i32
    lib.sl_rms_norm.argtypes = [p, i64, p, p, i64, i64, ctypes.c_float, i32]
    lib.sl_silu_mul.argtypes = [p, p, i64, i64, i32]
    lib.sl_rope_store.argtypes = [p, i64, i64, i64, i64, p, p, p, p, p, i32]
    lib.sl_decoder_stack.argtypes = [p, i64, p, i64, i64, i64, i64, i64, i64, ctypes.c_float]
    lib.sl_decoder_stack.argtypes += [p, p, p, p, i64, p, p, p, i64, i64, i32, i32]
    for f in (lib.sl_rms_norm, lib.sl_silu_mul, lib.sl_rope_store, lib.sl_decoder_stack,
              lib.sl_qlinear, lib.sl_dequantize):  # fmt: skip
        f.restype = None
    _lib = lib
    return lib


def available() -> bool:
    return enabled and _load() is not None


def int8_dot_available() -> bool:
    """Whether the built kernels take ``q4_1x16`` weights (AVX512-VNNI integer dots)."""
    return available() and bool(_lib.sl_int8_dot())


def bf16_dot_available() -> bool:
    """Whether the built kernels take ``bf16x16`` weights (AVX512-BF16 dot products)."""
    return available() and bool(_lib.sl_bf16_dot())


def fp32_interleave_available() -> bool:
    """Whether the built kernels take ``f32x16`` weights (the AVX-512 builds)."""
    return available() and bool(_lib.sl_f32_interleaved())


def set_num_threads(n: int) -> None:
    global _threads
    _threads = max(1, int(n))


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ w.T (+ b)``; with ``residual`` ([m, n] contiguous) the product is added into
    it in place, and it is returned."""
    lib = _load()
    assert lib is not None, "check cpu_kernels.available() first"
    x = x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=torch.float32) if residual is None else residual
    lib.sl_linear(
        x.data_ptr(), w.data_ptr(), b.data_ptr() if b is not None else None, y.data_ptr(),
        m, n, k, residual is not None, _threads,
    )  # fmt: skip
    return y


def qlinear(
    x: torch.Tensor,
    w: QuantWeight,
    b: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``linear`` with quantised weights: ``x`` [m, w.k] fp32."""
    lib = _load()
    assert lib is not None, "check cpu_kernels.available() first"
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty((m, w.n), dtype=torch.float32) if residual is None else residual
    lib.sl_qlinear(
        x.data_ptr(), w.blocks.data_ptr(), b.data_ptr() if b is not None else None,
        y.data_ptr(), m, w.n, w.k, residual is not None, w.kind_id, _threads,
    )  # fmt: skip
    return y


def dequantize(w: QuantWeight) -> torch.Tensor:
    """The fp32 matrix [w.n, w.k] of quantised weights."""
    if w.kind == "f32x16":
        return f32_rows(w).clone()
    if w.kind == "bf16x16":
        return f32_rows(w)
    out = torch.empty((w.n, w.k), dtype=torch.float32)
    _lib.sl_dequantize(w.blocks.data_ptr(), out.data_ptr(), w.n, w.k, w.kind_id, _threads)
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    rows: torch.Tensor,
    seq: torch.Tensor,
    pos: torch.Tensor,
    tables: torch.Tensor,
    *,
    prefill: bool = False,
) -> None:
    """Write into ``out[rows[t]]`` the attention of query ``q[rows[t]]`` over positions
    ``0..pos[t]`` of sequence ``seq[t]``, whose cache blocks are ``tables[seq[t]]``.

    ``q`` [T, n_q, d] (any token stride, heads contiguous), ``out`` [T, n_q, d] contiguous,
    ``k_cache``/``v_cache`` [num_blocks, block_size, n_kv, d] contiguous, ``rows``/``seq``/
    ``pos`` int32 [N], ``tables`` int32 [B, max_blocks] contiguous.

    ``prefill`` runs the kernel for query tokens that come in runs (prefill chunks:
    consecutive rows and positions of one sequence): 32 tokens of a run share each read of
    their context (flash attention, online softmax). Check ``prefill_attention_available``.
    """
    lib = _load()
    assert lib is not None, "check cpu_kernels.available() first"
    _, n_q, d = q.shape
    _, bs, n_kv, _ = k_cache.shape
    if q.stride(2) != 1 or q.stride(1) != d or not out.is_contiguous():
        raise ValueError("paged attention needs heads contiguous in q and a contiguous out")
    kernel = lib.sl_prefill_attention if prefill else lib.sl_paged_attention
    done = kernel(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        tables.shape[1], rows.data_ptr(), seq.data_ptr(), pos.data_ptr(), rows.shape[0],
        out.data_ptr(), n_q, n_kv, d, bs, d**-0.5, _threads,
    )  # fmt: skip
    assert done or not prefill, "check prefill_attention_available() first"


@functools.cache
def prefill_attention_available() -> bool:
    """Whether ``paged_attention(prefill=True)`` is built (the AVX-512 library): asked once,
    with no tokens."""
    lib = _load()
    if lib is None:
        return False
    return bool(lib.sl_prefill_attention(None, 0, None, None, None, 0, None, None, None, 0,
                                         None, 1, 1, 16, 1, 1.0, 1))  # fmt: skip


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of ``x`` [rows, dim] (rows may be strided), scaled by ``w``."""
    rows, dim = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((rows, dim), dtype=torch.float32)
    _lib.sl_rms_norm(
        x.data_ptr(), x.stride(0), w.data_ptr(), out.data_ptr(), rows, dim, eps, _threads
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` [rows, 2 * inter] contiguous: [rows, inter]."""
    rows, width = gate_up.shape
    out = torch.empty((rows, width // 2), dtype=torch.float32)
    _lib.sl_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, _threads)
    return out


def rope_store(
    qkv: torch.Tensor,
    n_q: int,
    n_kv: int,
    rope: torch.Tensor,
    positions: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor] | None,
    slots: torch.Tensor | None,
) -> None:
    """Rotate, in place, the q and k heads of ``qkv`` [rows, (n_q + 2 n_kv) * d]
    (contiguous, rotary pairs adjacent) by ``rope`` [max_pos, d / 2, 2] (cos, sin) at
    ``positions`` (int64); then store each row's k and v at its cache slot (int64 ``slots``)
    in ``kv`` = (K, V) [num_blocks, block_size, n_kv, d], when given."""
    rows, width = qkv.shape
    d = width // (n_q + 2 * n_kv)
    k_ptr = v_ptr = s_ptr = None
    if kv is not None:
        k_ptr, v_ptr, s_ptr = kv[0].data_ptr(), kv[1].data_ptr(), slots.data_ptr()
    _lib.sl_rope_store(
        qkv.data_ptr(), rows, n_q, n_kv, d, rope.data_ptr(), positions.data_ptr(),
        k_ptr, v_ptr, s_ptr, _threads,
    )  # fmt: skip


# The order of one layer's tensors in ``decoder_stack``'s pointer table (the C struct).
LAYER_TENSORS = ("ln1", "qkv_w", "qkv_b", "o_w", "ln2", "gate_up_w", "down_w", "k", "v")


def layer_table(layers: list[dict[str, torch.Tensor | None]]) -> torch.Tensor:
    """The pointer table ``decoder_stack`` reads: per layer, the addresses of its
    ``LAYER_TENSORS`` (fp32, contiguous; ``qkv_b`` may be None; the four weights may be
    ``QuantWeight``s, all of one kind). The tensors must outlive every call that uses it."""

    def address(t: torch.Tensor | QuantWeight | None) -> int:
        if t is None:
            return 0
        return t.blocks.data_ptr() if isinstance(t, QuantWeight) else t.data_ptr()

    ptrs = [address(t[name]) for t in layers for name in LAYER_TENSORS]
    return torch.tensor(ptrs, dtype=torch.int64)


def decoder_stack(
    x: torch.Tensor,
    table: torch.Tensor,
    n_layers: int,
    shape: tuple[int, int, int, int, float],
    rope: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
    rows: torch.Tensor,
    seq: torch.Tensor,
    pos: torch.Tensor,
    tables: torch.Tensor,
    kind_id: int = 0,
) -> None:
    """Run ``n_layers`` decoder layers on ``x`` [m, hidden] (contiguous, updated in place
    to the last layer's output, before the final norm), storing each token's K/V at its
    ``slots`` (int64) in the caches named by ``table`` (``layer_table``).

    ``shape`` = (n_q, n_kv, head_dim, intermediate, rms eps); ``rope`` [max_pos, d / 2, 2]
    (cos, sin) at int64 ``positions``; attention as in ``paged_attention``: query token
    ``rows[t]`` of sequence ``seq[t]`` at ``pos[t]`` over block tables ``tables``.
    ``kind_id``: the layers' weights' ``QuantWeight.kind_id`` (0: fp32).
    """
    m, hidden = x.shape
    n_q, n_kv, d, inter, eps = shape
    _lib.sl_decoder_stack(
        x.data_ptr(), m, table.data_ptr(), n_layers, hidden, n_q, n_kv, d, inter, eps,
        rope.data_ptr(), positions.data_ptr(), slots.data_ptr(), tables.data_ptr(),
        tables.shape[1], rows.data_ptr(), seq.data_ptr(), pos.data_ptr(), rows.shape[0],
        block_size, kind_id, _threads,
    )  # fmt: skip
