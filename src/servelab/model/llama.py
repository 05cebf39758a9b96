"""A Llama-family decoder (Llama, Mistral, SmolLM, Qwen2) over a flattened token batch.

One forward runs any mix of sequences: prefill chunks and decode tokens, each with any
number of query tokens. The caller (the runner) describes the batch in a
``ForwardBatch``: token ids and positions, where each token's K/V goes in the paged
cache (``slot_mapping``), how attention is grouped, and which rows need logits.

Layout choices (all internal; weights load from and export to the HF layout):
- q/k/v are one fused weight, gate/up another: fewer, larger matrix products.
- Q and K rows are permuted so each head's rotary pairs (i, i + head_dim/2) are adjacent;
  RoPE is then one complex multiply over q and k together. Dot products q.k are unchanged
  because both sides carry the same permutation; the KV cache holds K in this layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from servelab.model import cpu_kernels, ops
from servelab.model.linear import linear
from servelab.model.quant import (
    QuantWeight,
    f32_rows,
    interleave,
    interleave_bf16,
    interleave_f32,
)
from servelab.model.rope import rope_table
from servelab.modelcore.config import ModelConfig


@dataclass
class AttentionGroup:
    """Sequences whose attention is computed in one SDPA call.

    ``fresh``: one sequence whose query tokens ``tokens`` (a slice of the batch) start at
    position 0, so it attends causally to its own new K/V and reads no cache.

    Otherwise (paged) the group holds ``batch_size`` sequences padded to ``max_q`` queries:
    - queries: ``tokens`` when they are one contiguous run of the batch with exactly
      ``max_q`` tokens per sequence (the decode case: no gather), else ``q_index``
      [B, max_q] batch token indices (padding repeats a real token) with ``q_valid``
      [B, max_q] marking real queries;
    - keys/values: whole cache blocks, ``kv_blocks`` [B * n] block ids gathered with one
      index_select, or ``kv_block_range`` (first, n) for one sequence whose blocks are
      consecutive (a zero-copy view); each sequence sees ``n * block_size`` positions;
    - ``mask`` [B, 1, max_q, n * block_size] additive (0 / -inf), in the compute dtype:
      causality and the end of each context; None when every key is visible.

    Or (``tables`` set) the sequences go to servelab's CPU kernel, which reads K/V in place:
    query token ``rows[i]`` (int32 batch index) of sequence ``seq[i]`` at position ``pos[i]``,
    with block tables ``tables`` [B, max_blocks] int32 (see ``cpu_kernels.paged_attention``);
    ``max_q`` above ``BATCHED_MAX_QUERY`` makes it a prefill chunk, for the kernel's
    ``prefill`` form.
    """

    fresh: bool
    tokens: slice | None = None
    batch_size: int = 1
    max_q: int = 1
    q_index: torch.Tensor | None = None
    q_valid: torch.Tensor | None = None
    kv_blocks: torch.Tensor | None = None
    kv_block_range: tuple[int, int] | None = None
    mask: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    seq: torch.Tensor | None = None
    pos: torch.Tensor | None = None
    tables: torch.Tensor | None = None


# Sequences with at most this many query tokens share one padded attention call (or the
# per-token CPU kernel); longer ones (prefill chunks) get their own, so padding never
# multiplies prefill work, and on CPU the tiled prefill kernel.
BATCHED_MAX_QUERY = 16


@dataclass
class ForwardBatch:
    """Inputs of one forward pass. ``sample_index`` None means logits for every token."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    groups: list[AttentionGroup]
    slot_mapping: torch.Tensor | None = None  # [T] long: cache slot of each token's K/V
    sample_index: torch.Tensor | None = None  # [S] long: rows that need logits


def to_interleaved_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the rows of a Q/K weight (or bias) so rotary pairs of each head are adjacent."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)


Weight = torch.Tensor | QuantWeight


def _weight(t: Weight, interleave_fp32: bool) -> nn.Parameter | QuantWeight:
    """A fused weight as the model holds it: rows interleaved by 16 where the CPU kernels
    take that layout (``quant.interleave`` for integer dots, ``quant.interleave_bf16`` for
    bf16, ``quant.interleave_f32`` for fp32 when ``interleave_fp32``)."""
    if isinstance(t, QuantWeight):
        if t.kind == "bf16":  # the loader checked that the bf16 kernel is built
            return interleave_bf16(t)
        if t.n % 16 == 0 and cpu_kernels.int8_dot_available():
            return interleave(t)
        return QuantWeight(t.kind, t.blocks.contiguous(), t.k)
    if interleave_fp32 and t.dtype == torch.float32 and t.shape[0] % 16 == 0:
        return interleave_f32(t.contiguous())
    return _param(t)


def _embed(table: nn.Parameter | QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(table, QuantWeight):  # a tied LM head, interleaved
        return f32_rows(table, ids)
    return F.embedding(ids, table)


def _rotary_rows(w: Weight, n_heads: int) -> Weight:
    """``to_interleaved_rotary`` on a weight of either kind (quantised rows move whole)."""
    if isinstance(w, QuantWeight):
        return QuantWeight(w.kind, to_interleaved_rotary(w.blocks, n_heads), w.k)
    return to_interleaved_rotary(w, n_heads)


def _cat_rows(ws: list[Weight]) -> Weight:
    if isinstance(ws[0], QuantWeight):
        if len({(w.kind, w.k) for w in ws}) != 1:
            raise ValueError("fused weights must share one quantization kind")
        return QuantWeight(ws[0].kind, torch.cat([w.blocks for w in ws]), ws[0].k)
    return torch.cat(ws)


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, w: dict[str, Weight], prefix: str, interleave_fp32: bool
    ) -> None:
        super().__init__()
        self.cfg = cfg
        nq, nkv = cfg.num_heads, cfg.num_kv_heads
        q = _rotary_rows(w[prefix + "self_attn.q_proj.weight"], nq)
        k = _rotary_rows(w[prefix + "self_attn.k_proj.weight"], nkv)
        v = w[prefix + "self_attn.v_proj.weight"]
        self.qkv_w = _weight(_cat_rows([q, k, v]), interleave_fp32)
        self.qkv_b: nn.Parameter | None = None
        if cfg.qkv_bias:
            qb = to_interleaved_rotary(w[prefix + "self_attn.q_proj.bias"], nq)
            kb = to_interleaved_rotary(w[prefix + "self_attn.k_proj.bias"], nkv)
            self.qkv_b = _param(torch.cat([qb, kb, w[prefix + "self_attn.v_proj.bias"]]))
        self.o_w = _weight(w[prefix + "self_attn.o_proj.weight"], interleave_fp32)
        self.gate_up_w = _weight(
            _cat_rows([w[prefix + "mlp.gate_proj.weight"], w[prefix + "mlp.up_proj.weight"]]),
            interleave_fp32,
        )
        self.down_w = _weight(w[prefix + "mlp.down_proj.weight"], interleave_fp32)
        self.ln1 = _param(w[prefix + "input_layernorm.weight"])
        self.ln2 = _param(w[prefix + "post_attention_layernorm.weight"])

    def forward(
        self,
        x: torch.Tensor,
        rotary: ops.Rotary,
        batch: ForwardBatch,
        kv: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        cfg = self.cfg
        n_tok, nq, nkv, hd = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = ops.rms_norm(x, self.ln1, cfg.rms_norm_eps)
        qkv = linear(h, self.qkv_w, self.qkv_b)
        q, k, v = ops.rotate_and_store(qkv, nq, nkv, rotary, kv, batch.slot_mapping)
        attn = _attention(q, k, v, batch.groups, kv)
        x = linear(attn.reshape(n_tok, nq * hd), self.o_w, residual=x)
        h = ops.rms_norm(x, self.ln2, cfg.rms_norm_eps)
        return linear(ops.swiglu(linear(h, self.gate_up_w)), self.down_w, residual=x)


def _gather_kv(cache: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
    """[B, n_kv_heads, n * block_size, head_dim] keys or values of a paged group."""
    if g.kv_block_range is not None:
        first, n = g.kv_block_range
        blocks = cache[first : first + n]
    else:
        blocks = cache.index_select(0, g.kv_blocks)
    return blocks.view(g.batch_size, -1, *cache.shape[2:]).transpose(1, 2)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: list[AttentionGroup],
    kv: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """[T, nq, hd] attention output for every query token of the batch."""
    # One group that covers the batch in order returns its output as is.
    single = len(groups) == 1 and (groups[0].fresh or groups[0].tokens is not None)
    out = None if single else q.new_empty(q.shape)
    for g in groups:
        if not g.fresh and kv is None:
            raise ValueError("a paged attention group needs the KV cache")
        if g.tables is not None:
            prefill = g.max_q > BATCHED_MAX_QUERY
            cpu_kernels.paged_attention(
                q, kv[0], kv[1], out, g.rows, g.seq, g.pos, g.tables, prefill=prefill
            )
            continue
        if g.fresh:
            s = g.tokens
            o = F.scaled_dot_product_attention(
                q[s].transpose(0, 1).unsqueeze(0),
                k[s].transpose(0, 1).unsqueeze(0),
                v[s].transpose(0, 1).unsqueeze(0),
                is_causal=True,
                enable_gqa=True,
            )[0].transpose(0, 1)
            if single:
                return o
            out[s] = o
            continue
        if g.tokens is not None:
            qg = q[g.tokens].view(g.batch_size, g.max_q, *q.shape[1:])
        else:
            qg = q[g.q_index]
        o = F.scaled_dot_product_attention(
            qg.transpose(1, 2),
            _gather_kv(kv[0], g),
            _gather_kv(kv[1], g),
            attn_mask=g.mask,
            enable_gqa=True,
        ).transpose(1, 2)  # [B, max_q, nq, hd]
        if g.tokens is not None:
            o = o.reshape(-1, *o.shape[2:])
            if single:
                return o
            out[g.tokens] = o
        elif g.q_valid is None:
            out[g.q_index.reshape(-1)] = o.reshape(-1, *o.shape[2:])
        else:
            out[g.q_index[g.q_valid]] = o[g.q_valid]
    return out


class LlamaForCausalLM(nn.Module):
    """The decoder with its embedding and LM head. ``forward`` returns logits [S, vocab].

    Linear weights and the LM head may be ``QuantWeight``s (all layers of one kind; CPU
    only), run by servelab's kernels: quantised blocks, or on CPU with the AVX-512 kernels
    fp32 rows interleaved by 16 (``quant.interleave_f32``; a tied embedding then lives only
    in that layout, its rows read back for lookups). ``dtype`` and ``device`` are the
    model's compute dtype and device.
    """

    def __init__(
        self, cfg: ModelConfig, weights: dict[str, Weight], device: torch.device | str
    ) -> None:
        super().__init__()
        self.config = cfg
        pack = torch.device(device).type == "cpu" and cpu_kernels.fp32_interleave_available()
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, weights, f"model.layers.{i}.", pack) for i in range(cfg.num_layers)
        )
        self.norm = _param(weights["model.norm.weight"])
        embed, head = weights["model.embed_tokens.weight"], weights.get("lm_head.weight")
        self.embed: nn.Parameter | QuantWeight
        self.lm_head: nn.Parameter | QuantWeight
        # A quantised head (q4_1's own blocks, q8_0's, bf16) is its own weight even when tied.
        if not isinstance(head, QuantWeight) and (cfg.tie_word_embeddings or head is None):
            self.embed = _weight(embed, pack)
            self.lm_head = self.embed
        else:
            self.embed = _param(embed)
            self.lm_head = _weight(head, pack)
        self.to(device)
        kinds = {
            w.kind_id if isinstance(w, QuantWeight) else 0
            for L in self.layers
            for w in (L.qkv_w, L.o_w, L.gate_up_w, L.down_w)
        }
        self.weight_kind_id = min(kinds, default=0)
        self.register_buffer("rope", rope_table(cfg, cfg.max_model_len, device), persistent=False)
        # Few-token steps run all layers in one CPU kernel call (benchmarks flip this); the
        # call takes one weight kind for every layer.
        self.fuse_decode = len(kinds) <= 1
        self._stack: tuple[tuple, torch.Tensor] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.device

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        x = _embed(self.embed, batch.input_ids)
        rotary = ops.Rotary(self.rope, batch.positions)
        if self._fusable(x, batch, kv_caches):
            self._decoder_stack(x, rotary, batch, kv_caches)
        else:
            for i, layer in enumerate(self.layers):
                x = layer(x, rotary, batch, kv_caches[i] if kv_caches is not None else None)
        if batch.sample_index is not None:
            x = x[batch.sample_index]
        return linear(ops.rms_norm(x, self.norm, self.config.rms_norm_eps), self.lm_head)

    def _fusable(self, x: torch.Tensor, batch: ForwardBatch, kv: list | None) -> bool:
        """A few-token step whose attention is all on the paged CPU kernel."""
        g = batch.groups
        return (
            self.fuse_decode
            and kv is not None
            and len(g) == 1
            and g[0].tables is not None
            and x.shape[0] <= cpu_kernels.MAX_ROWS
            and ops.use_kernels(x)
        )

    def _decoder_stack(
        self,
        x: torch.Tensor,
        rotary: ops.Rotary,
        batch: ForwardBatch,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Every layer on ``x`` in place, in one ``cpu_kernels.decoder_stack`` call."""
        cfg = self.config
        # The pointer table is rebuilt when the caches change (a new runner's allocation can
        # reuse an old address, so their shape is part of the key). Weights stay put once
        # the model is on its device.
        key = (kv[0][0].data_ptr(), kv[-1][1].data_ptr(), kv[0][0].shape, len(kv))
        if self._stack is None or self._stack[0] != key:
            tensors = [
                {"ln1": L.ln1, "qkv_w": L.qkv_w, "qkv_b": L.qkv_b, "o_w": L.o_w, "ln2": L.ln2,
                 "gate_up_w": L.gate_up_w, "down_w": L.down_w, "k": k, "v": v}
                for L, (k, v) in zip(self.layers, kv)
            ]  # fmt: skip
            self._stack = (key, cpu_kernels.layer_table(tensors))
        g = batch.groups[0]
        shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size)
        cpu_kernels.decoder_stack(
            x, self._stack[1], cfg.num_layers, (*shape, cfg.rms_norm_eps), rotary.real_table,
            batch.positions, batch.slot_mapping, kv[0][0].shape[1], g.rows, g.seq, g.pos,
            g.tables, self.weight_kind_id,
        )  # fmt: skip


def causal_batch(token_ids: list[list[int]], device: torch.device | str = "cpu") -> ForwardBatch:
    """A cache-free batch: each sequence prefilled from position 0, logits at every token."""
    ids, pos, groups, start = [], [], [], 0
    for seq in token_ids:
        ids += seq
        pos += range(len(seq))
        groups.append(AttentionGroup(fresh=True, tokens=slice(start, start + len(seq))))
        start += len(seq)
    as_long = {"dtype": torch.long, "device": device}
    return ForwardBatch(torch.tensor(ids, **as_long), torch.tensor(pos, **as_long), groups)
