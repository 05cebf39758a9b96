"""The per-token operations of a decoder layer, each on servelab's CPU kernel where it
applies (fp32 on CPU, kernels built) and on torch everywhere else.

At decode sizes a layer's cost outside its matrix products is the dispatch of many small
torch ops (RMSNorm alone decomposes into seven), not their arithmetic; one kernel call
each brings that down. Both paths compute the same function to float rounding; the
model's tests run the kernel path and compare against HF transformers.
"""

from __future__ import annotations

from functools import cached_property

import torch
import torch.nn.functional as F

from servelab.model import cpu_kernels


def use_kernels(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and cpu_kernels.available()


class Rotary:
    """The rotary table ``[max_pos, head_dim / 2]`` complex and one batch's positions."""

    def __init__(self, table: torch.Tensor, positions: torch.Tensor) -> None:
        self.table = table
        self.positions = positions

    @cached_property
    def rows(self) -> torch.Tensor:
        """[T, 1, head_dim / 2]: each token's rotation, for the torch path."""
        return self.table[self.positions].unsqueeze(1)

    @cached_property
    def real_table(self) -> torch.Tensor:
        return torch.view_as_real(self.table)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if use_kernels(x):
        return cpu_kernels.rms_norm(x, w, eps)
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused gate/up product [T, 2 * inter]."""
    if use_kernels(gate_up) and gate_up.is_contiguous():
        return cpu_kernels.silu_mul(gate_up)
    inter = gate_up.shape[1] // 2
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def rotate_and_store(
    qkv: torch.Tensor,
    n_q: int,
    n_kv: int,
    rotary: Rotary,
    kv: tuple[torch.Tensor, torch.Tensor] | None,
    slots: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE on the q and k heads of the fused ``qkv`` [T, (n_q + 2 n_kv) * d]; k and v
    stored at their cache ``slots`` when ``kv`` is given. Returns q [T, n_q, d] and k, v
    [T, n_kv, d] (views; heads contiguous, tokens strided)."""
    n = qkv.shape[0]
    d = qkv.shape[1] // (n_q + 2 * n_kv)
    qk_width = (n_q + n_kv) * d
    if use_kernels(qkv) and qkv.is_contiguous():
        cpu_kernels.rope_store(qkv, n_q, n_kv, rotary.real_table, rotary.positions, kv, slots)
        q = qkv[:, : n_q * d].view(n, n_q, d)
        k = qkv[:, n_q * d : qk_width].view(n, n_kv, d)
        return q, k, qkv[:, qk_width:].view(n, n_kv, d)
    qk = torch.view_as_complex(qkv[:, :qk_width].view(n, n_q + n_kv, d // 2, 2))
    qk = torch.view_as_real(qk * rotary.rows).view(n, n_q + n_kv, d)
    q, k = qk[:, :n_q], qk[:, n_q:]
    v = qkv[:, qk_width:].view(n, n_kv, d)
    if kv is not None:
        kv[0].view(-1, n_kv, d).index_copy_(0, slots, k)
        kv[1].view(-1, n_kv, d).index_copy_(0, slots, v)
    return q, k, v
