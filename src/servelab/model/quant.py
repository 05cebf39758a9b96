"""Quantised linear weights: GGUF blocks kept as they are in memory.

Contract:
- ``MODES`` = ("none", "bf16", "q8_0", "q4_1"); ``check_mode(mode)`` raises ValueError for
  others.
- ``QuantWeight(kind, blocks, k)``: an [n, k] weight matrix as ``blocks`` (uint8 [n,
  k / 32 * bytes per block], one row of blocks per output row, GGUF's byte layout, see
  ``csrc/cpu_kernels.c``). Row permutations and concatenations are done on ``blocks``:
  a block never straddles two rows.
- ``quantize(weights, mode, path)``: the HF-named fp32 weights with every linear weight
  (and the LM head, ``lm_head.weight`` even when tied) replaced by a ``QuantWeight``:
  ``q8_0`` quantises the fp32 weights (cached beside the fp32 weight cache for a GGUF);
  ``q4_1`` takes the GGUF's own Q4_1 blocks, and its LM head's own blocks when they are
  Q8_0 or Q4_1; ``bf16`` rounds every linear weight and the LM head to bf16 (kind
  ``bf16``: ``blocks`` a bfloat16 [n, k] tensor). Norms and the embedding table stay fp32.
- ``interleave(w)``: a Q4_1 or Q8_0 weight of a multiple of 16 rows as kind ``q4_1x16`` or
  ``q8_0x16``: the same bytes reordered for the integer-dot kernels (16 rows' blocks side by
  side, see ``csrc/cpu_kernels.c``, kinds 3 and 4); ``deinterleave`` undoes it. Rows of an
  interleaved weight no longer move one by one, so this is done last, on fused matrices.
- ``interleave_f32(t)``: an fp32 [n, k] matrix (n a multiple of 16) as kind ``f32x16``, whose
  ``blocks`` (fp32, shape [n, k]) hold its values as [n / 16][k][16]: for each group of 16
  rows, their k columns side by side (the fp32 kernel's layout, kind 5). ``f32_rows(w,
  rows)`` reads rows of it back (all of them when ``rows`` is None): the embedding lookup
  of a tied LM head.
- ``interleave_bf16(w)``: a ``bf16`` weight (n a multiple of 16, k even) as kind ``bf16x16``,
  whose ``blocks`` (bfloat16 [n, k]) hold [n / 16][k / 2][16][2]: for each group of 16 rows
  and each pair of columns, the 16 rows' two values side by side (the bf16 kernel's layout,
  kind 6). ``f32_rows`` reads its rows back as fp32 too.

Why: a decode step streams every weight once, so its floor is the weight bytes over the
memory bandwidth; bf16 is half of fp32's bytes, Q8_0 34/128 and Q4_1 20/128.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# q8_0 is the model layer's and the benchmarks'; the CLI offers vocab.QUANTIZATION_MODES.
MODES = ("none", "bf16", "q8_0", "q4_1")

# The C kernels' kind numbers.
_KIND_IDS = {"q8_0": 1, "q4_1": 2, "q4_1x16": 3, "q8_0x16": 4, "f32x16": 5, "bf16x16": 6}
_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Interleaved kinds: (GGUF kind, scale bytes, quant bytes) of a block.
_INTERLEAVED = {"q4_1x16": ("q4_1", 4, 16), "q8_0x16": ("q8_0", 2, 32)}


@dataclass
class QuantWeight:
    kind: str
    blocks: torch.Tensor
    k: int

    @property
    def n(self) -> int:
        return self.blocks.shape[0]

    @property
    def kind_id(self) -> int:
        return _KIND_IDS[self.kind]

    @property
    def interleaved(self) -> bool:
        """Rows reordered in groups of 16 (``interleave``, ``interleave_f32``): the kernels
        take these at every row count."""
        return self.kind in _INTERLEAVED or self.kind in ("f32x16", "bf16x16")


def interleave_f32(t: torch.Tensor) -> QuantWeight:
    """See the module docstring; ValueError for rows not a multiple of 16."""
    n, k = t.shape
    if n % 16:
        raise ValueError(f"interleave_f32 takes 16k rows, not {n}")
    return QuantWeight("f32x16", t.view(n // 16, 16, k).transpose(1, 2).reshape(n, k), k)


def interleave_bf16(w: QuantWeight) -> QuantWeight:
    """See the module docstring; ValueError for another kind, rows not a multiple of 16 or
    an odd number of columns."""
    n, k = w.blocks.shape
    if w.kind != "bf16" or n % 16 or k % 2:
        raise ValueError(f"interleave_bf16 takes bf16 weights of 16k rows and even columns, "
                         f"not {w.kind} {n} x {k}")  # fmt: skip
    pairs = w.blocks.view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3)
    return QuantWeight("bf16x16", pairs.reshape(n, k).contiguous(), k)


def f32_rows(w: QuantWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``rows`` (a long tensor; all when None) of an ``f32x16`` or ``bf16x16``
    weight, as fp32 [len, k]."""
    if w.kind == "bf16x16":
        pairs = w.blocks.view(w.n // 16, w.k // 2, 16, 2)
        if rows is None:
            return pairs.permute(0, 2, 1, 3).reshape(w.n, w.k).float()
        return pairs[rows // 16, :, rows % 16].reshape(-1, w.k).float()
    groups = w.blocks.view(w.n // 16, w.k, 16)
    if rows is None:
        return groups.transpose(1, 2).reshape(w.n, w.k)
    return groups[rows // 16, :, rows % 16]


def interleave(w: QuantWeight) -> QuantWeight:
    """See the module docstring; ValueError for another kind or rows not a multiple of 16."""
    kind = {base: name for name, (base, _, _) in _INTERLEAVED.items()}.get(w.kind)
    if kind is None or w.n % 16:
        raise ValueError(f"interleave takes q4_1 or q8_0 weights of 16k rows, not {w.kind} x {w.n}")
    _, sb, qb = _INTERLEAVED[kind]
    nb = w.k // 32
    b = w.blocks.view(-1, 16, nb, sb + qb)  # [groups, 16 rows, blocks, block bytes]
    # -> [groups, blocks, scale / word, 16 lanes, 2 / 4 bytes]
    scales = b[..., :sb].reshape(-1, 16, nb, sb // 2, 2).permute(0, 2, 3, 1, 4)
    words = b[..., sb:].reshape(-1, 16, nb, qb // 4, 4).permute(0, 2, 3, 1, 4)
    out = torch.cat([scales.reshape(-1, nb, 16 * sb), words.reshape(-1, nb, 16 * qb)], dim=2)
    return QuantWeight(kind, out.reshape(w.n, -1).contiguous(), w.k)


def deinterleave(w: QuantWeight) -> QuantWeight:
    base, sb, qb = _INTERLEAVED[w.kind]
    nb = w.k // 32
    g = w.blocks.view(-1, nb, 16 * (sb + qb))
    scales = g[..., : 16 * sb].reshape(-1, nb, sb // 2, 16, 2).permute(0, 3, 1, 2, 4)
    words = g[..., 16 * sb :].reshape(-1, nb, qb // 4, 16, 4).permute(0, 3, 1, 2, 4)
    out = torch.cat([scales.reshape(-1, 16, nb, sb), words.reshape(-1, 16, nb, qb)], dim=3)
    return QuantWeight(base, out.reshape(w.n, -1).contiguous(), w.k)


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"quantization {mode!r} is not known: use {', '.join(MODES)}")


def is_linear(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in _LINEAR and parts[-1] == "weight"


def quantize_q8_0(w: np.ndarray) -> np.ndarray:
    """GGUF Q8_0 blocks (uint8 [n, k / 32 * 34]) of an fp32 [n, k] matrix."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    if w.shape[-1] % 32:
        raise ValueError(f"q8_0 needs rows of a multiple of 32 weights, got {w.shape}")
    return gguf_quantize(np.ascontiguousarray(w, dtype=np.float32), GGMLQuantizationType.Q8_0)


def _head_name(weights: dict[str, torch.Tensor]) -> str:
    return "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"


def _q8_0_blocks(weights: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    names = [n for n in weights if is_linear(n)]
    out = {n: quantize_q8_0(weights[n].numpy()) for n in names}
    out["lm_head.weight"] = quantize_q8_0(weights[_head_name(weights)].numpy())
    return out


def _gguf_q4_1_blocks(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, np.ndarray]:
    """The GGUF's Q4_1 linear weights (and its LM head's blocks) as HF-layout rows."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader

    from servelab.model.gguf_load import hf_name, unpermute_rotary
    from servelab.modelcore.gguf_meta import read_metadata

    reader = GGUFReader(str(path))
    arch = read_metadata(str(path)).get("general.architecture")
    out: dict[str, np.ndarray] = {}
    other: set[str] = set()
    head: tuple[str, np.ndarray] | None = None
    for t in reader.tensors:
        name = hf_name(t.name)
        if name in ("lm_head.weight", "model.embed_tokens.weight") and t.tensor_type in (
            T.Q8_0,
            T.Q4_1,
        ):
            if head is None or name == "lm_head.weight":
                head = (t.tensor_type.name.lower(), np.asarray(t.data))
        if name is None or not is_linear(name):
            continue
        if t.tensor_type != T.Q4_1:
            other.add(t.tensor_type.name)
            continue
        blocks = np.asarray(t.data)
        # llama.cpp permutes Q/K rows of llama models; undo it, as read_gguf does for fp32.
        if arch == "llama" and ".q_proj." in name:
            blocks = unpermute_rotary(blocks, num_heads)
        elif arch == "llama" and ".k_proj." in name:
            blocks = unpermute_rotary(blocks, num_kv_heads)
        out[name] = np.array(blocks, order="C")  # a copy: the reader's arrays are read-only
    if other or not out:
        found = ", ".join(sorted(other)) or "no linear weights"
        raise ValueError(
            f"--quantization q4_1 runs a GGUF's own Q4_1 blocks, but the linear weights of "
            f"{path.name} are not all Q4_1 (others: {found}); available: none"
        )
    if head is not None:
        out["lm_head.weight"] = np.array(head[1], order="C")
        out["lm_head.kind"] = np.frombuffer(head[0].encode(), dtype=np.uint8)
    return out


def quantize(
    weights: dict[str, torch.Tensor],
    mode: str,
    path: Path,
    num_heads: int,
    num_kv_heads: int,
) -> dict[str, torch.Tensor | QuantWeight]:
    """See the module docstring. ``path`` is the resolved model (a .gguf or HF dir)."""
    from servelab.modelcore.catalogue import is_gguf

    check_mode(mode)
    if mode == "none":
        return dict(weights)
    if mode == "bf16":
        out_bf16: dict[str, torch.Tensor | QuantWeight] = dict(weights)
        head = weights[_head_name(weights)]
        for name, t in [*((n, weights[n]) for n in weights if is_linear(n)),
                        ("lm_head.weight", head)]:  # fmt: skip
            out_bf16[name] = QuantWeight("bf16", t.to(torch.bfloat16), t.shape[1])
        return out_bf16
    if mode == "q4_1":
        if not is_gguf(path):
            raise ValueError(
                f"--quantization q4_1 runs a GGUF's own Q4_1 blocks; {path} holds safetensors "
                "weights: available: none"
            )
        blocks = _gguf_q4_1_blocks(path, num_heads, num_kv_heads)
    elif is_gguf(path):
        from servelab.model.weight_cache import cached_arrays

        blocks = cached_arrays(path, "q8_0", lambda: _q8_0_blocks(weights))
    else:
        blocks = _q8_0_blocks(weights)
    head_kind = bytes(blocks.pop("lm_head.kind", np.frombuffer(b"q8_0", np.uint8))).decode()
    out: dict[str, torch.Tensor | QuantWeight] = dict(weights)
    for name, b in blocks.items():
        kind = head_kind if name == "lm_head.weight" else mode
        k = weights[_head_name(weights) if name == "lm_head.weight" else name].shape[1]
        out[name] = QuantWeight(kind, torch.from_numpy(np.ascontiguousarray(b)), k)
    return out
