"""The torch executor: runs ``BatchPlan``s on a loaded model with a paged KV cache.

Contract (``servelab.engine.executor.Executor`` plus KV transfer):
- ``allocate_kv(num_blocks, block_size)`` makes, per layer, K and V tensors
  ``[num_blocks, block_size, n_kv_heads, head_dim]`` (one allocation, zero-filled);
  position ``p`` of a sequence lives at slot ``p % block_size`` of block
  ``block_table[p // block_size]``.
- ``execute(plan)`` runs one forward over all scheduled tokens (prefill chunks, decode
  tokens and draft tokens mixed), writes their K/V at their slots, computes logits only
  at sampled rows and returns the sampled tokens and the measured step time.
- ``read_blocks``/``write_blocks``/``copy_blocks`` move whole blocks (all layers, K and V);
  a block's data is one tensor ``[num_layers, 2, block_size, n_kv_heads, head_dim]`` on
  the runner's device.
- Thread count: ``num_threads`` applies to torch, to OpenBLAS and to servelab's CPU
  kernels, which the CPU linear layers and decode attention use. None keeps torch's count
  (all cores by default, or what the caller set with ``torch.set_num_threads`` before
  building the runner).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from servelab.engine.batch_plan import BatchPlan, ScheduledSeq, StepOutput
from servelab.model import cpu_kernels
from servelab.model.llama import BATCHED_MAX_QUERY, AttentionGroup, ForwardBatch
from servelab.model.loader import LoadedModel
from servelab.model.sampler import Sampler


def set_num_threads(num_threads: int | None) -> int:
    """Give torch and OpenBLAS ``num_threads`` threads and return the count.

    None keeps torch's current count (all cores unless the caller already chose, as
    ``servelab serve`` does before building the engine) and gives OpenBLAS the same.
    """
    from threadpoolctl import threadpool_limits

    n = num_threads or torch.get_num_threads()
    torch.set_num_threads(n)
    threadpool_limits(limits=n, user_api="blas")
    cpu_kernels.set_num_threads(n)
    return n


def _padded_table(table: list[int], width: int) -> list[int]:
    """The first ``width`` block ids of ``table``; past its end, block 0 (padding that
    attention masks out or never reads)."""
    return table[:width] + [0] * (width - len(table))


class TorchModelRunner:
    """Executes batch plans on ``loaded.model``; see the module docstring."""

    def __init__(
        self,
        loaded: LoadedModel,
        device: str | torch.device | None = None,
        num_threads: int | None = None,
        seed: int | None = None,
    ) -> None:
        self.loaded = loaded
        self.device = torch.device(device) if device is not None else loaded.device
        self.model = loaded.model.to(self.device)
        self.num_threads = set_num_threads(num_threads) if self.device.type == "cpu" else None
        # Decode attention reads the paged cache in place through servelab's CPU kernel
        # where it is built; elsewhere blocks are gathered for torch's SDPA.
        self.paged_kernel = (
            self.device.type == "cpu"
            and self.model.dtype == torch.float32
            and loaded.config.head_dim % 16 == 0
            and cpu_kernels.available()
        )
        # Prefill chunks too, 32 tokens a tile, where the AVX-512 kernel is built: torch's
        # SDPA ran a 700-token chunk over 1,400 cached positions at ~50 GFLOP/s on one core.
        self.prefill_kernel = self.paged_kernel and cpu_kernels.prefill_attention_available()
        cfg = loaded.config
        self.config = cfg
        self.max_model_len: int = cfg.max_model_len
        self.eos_token_ids: list[int] = loaded.tokenizer.eos_token_ids or cfg.eos_token_ids
        self.dtype = self.model.dtype
        self.sampler = Sampler(self.device, seed)
        self.block_size = 0
        self.num_blocks = 0
        self.kv: torch.Tensor | None = None  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        self._layer_kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ---- KV cache -------------------------------------------------------------------
    def kv_block_bytes(self, block_size: int) -> int:
        cfg = self.config
        itemsize = self.dtype.itemsize
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        cfg = self.config
        shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._layer_kv = [(self.kv[i, 0], self.kv[i, 1]) for i in range(cfg.num_layers)]
        self.block_size, self.num_blocks = block_size, num_blocks

    def _kv(self) -> torch.Tensor:
        if self.kv is None:
            raise RuntimeError("call allocate_kv(num_blocks, block_size) before using the KV cache")
        return self.kv

    def read_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        kv = self._kv()
        return [kv[:, :, b].clone() for b in block_ids]

    def write_blocks(self, block_ids: list[int], data: list[torch.Tensor]) -> None:
        kv = self._kv()
        if len(block_ids) != len(data):
            raise ValueError(f"{len(block_ids)} block ids but {len(data)} blocks of data")
        for b, d in zip(block_ids, data):
            kv[:, :, b].copy_(d)

    def draft_proposer(self, spec: Any, config: Any) -> Any:
        """``Executor.draft_proposer``: a draft or self-draft model beside this one."""
        from servelab.model.draft_model import build_draft_proposer

        return build_draft_proposer(self, spec, config)

    def copy_blocks(self, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        """Copy block ``src[i]`` onto ``dst[i]`` (copy-on-write, speculative roll-back)."""
        kv = self._kv()
        if len(src_block_ids) != len(dst_block_ids):
            raise ValueError("copy_blocks needs as many destination blocks as sources")
        if src_block_ids:
            dst = torch.tensor(dst_block_ids, device=self.device)
            src = torch.tensor(src_block_ids, device=self.device)
            kv.index_copy_(2, dst, kv.index_select(2, src))

    # ---- execution ------------------------------------------------------------------
    def execute(self, plan: BatchPlan) -> StepOutput:
        t0 = time.perf_counter()
        self._kv()
        if not plan.seqs:
            return StepOutput(sampled={}, elapsed=time.perf_counter() - t0)
        logits, sampled_seqs = self.logits(plan)
        sampled = self.sampler.sample(logits, sampled_seqs) if sampled_seqs else {}
        return StepOutput(sampled=sampled, elapsed=time.perf_counter() - t0)

    def logits(self, plan: BatchPlan) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Run the plan's forward (writing K/V) and return the logits of the sampled rows
        (``1 + len(draft_token_ids)`` per sampled sequence, in plan order) and those seqs."""
        self._kv()
        batch, sampled_seqs = self._build_batch(plan.seqs)
        return self.model(batch, self._layer_kv), sampled_seqs

    def _check(self, s: ScheduledSeq, end: int) -> None:
        if not s.token_ids:
            raise ValueError(f"request {s.request_id}: a scheduled sequence needs >= 1 token")
        if s.start_pos < 0 or end > self.max_model_len:
            raise ValueError(
                f"request {s.request_id}: positions {s.start_pos}..{end - 1} are outside the "
                f"model's context 0..{self.max_model_len - 1}"
            )
        need = -(-end // self.block_size)
        if len(s.block_table) < need:
            raise ValueError(
                f"request {s.request_id}: {end} positions need {need} blocks of "
                f"{self.block_size}, but the block table has {len(s.block_table)}"
            )
        bad = [b for b in s.block_table[:need] if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(
                f"request {s.request_id}: block ids {bad} are outside 0..{self.num_blocks - 1}"
            )

    def _build_batch(self, seqs: list[ScheduledSeq]) -> tuple[ForwardBatch, list[ScheduledSeq]]:
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_index: list[int] = []
        sampled: list[ScheduledSeq] = []
        groups: list[AttentionGroup] = []
        short: list[tuple[ScheduledSeq, int, int]] = []  # (seq, first token index, length)
        for s in seqs:
            ids = s.token_ids + s.draft_token_ids
            n, off, end = len(ids), len(tokens), s.start_pos + len(ids)
            self._check(s, end)
            tokens += ids
            positions += range(s.start_pos, end)
            bt = s.block_table
            slots += [bt[p // bs] * bs + p % bs for p in range(s.start_pos, end)]
            if s.sample:
                rows = 1 + len(s.draft_token_ids)
                sample_index += range(off + n - rows, off + n)
                sampled.append(s)
            if n <= BATCHED_MAX_QUERY:
                short.append((s, off, n))
            elif self.prefill_kernel:
                groups.append(self._kernel_group([(s, off, n)]))
            elif s.start_pos == 0:
                groups.append(AttentionGroup(fresh=True, tokens=slice(off, off + n)))
            else:
                groups.append(self._paged_group([(s, off, n)]))
        if short:
            groups.append(
                self._kernel_group(short) if self.paged_kernel else self._paged_group(short)
            )
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(tokens, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            groups=groups,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            sample_index=torch.tensor(sample_index, dtype=torch.long, device=dev),
        )
        return batch, sampled

    def _kernel_group(self, items: list[tuple[ScheduledSeq, int, int]]) -> AttentionGroup:
        """Attention metadata for the CPU kernel: per query token its batch row, sequence
        and position; per sequence its block table (padded with block 0, never read)."""
        bs = self.block_size
        rows, seq, pos, tables = [], [], [], []
        width = max(-(-(s.start_pos + n) // bs) for s, _, n in items)
        for i, (s, off, n) in enumerate(items):
            rows += range(off, off + n)
            seq += [i] * n
            pos += range(s.start_pos, s.start_pos + n)
            tables.append(_padded_table(s.block_table, width))
        as_int = {"dtype": torch.int32}
        return AttentionGroup(
            fresh=False,
            batch_size=len(items),
            max_q=max(n for _, _, n in items),
            rows=torch.tensor(rows, **as_int),
            seq=torch.tensor(seq, **as_int),
            pos=torch.tensor(pos, **as_int),
            tables=torch.tensor(tables, **as_int),
        )

    def _paged_group(self, items: list[tuple[ScheduledSeq, int, int]]) -> AttentionGroup:
        """Attention metadata for sequences that read their context from the cache."""
        bs, dev = self.block_size, self.device
        max_q = max(n for _, _, n in items)
        ctx = [s.start_pos + n for s, _, n in items]
        n_blocks = -(-max(ctx) // bs)
        width = n_blocks * bs
        g = AttentionGroup(fresh=False, batch_size=len(items), max_q=max_q)
        offsets = [off for _, off, _ in items]
        if all(n == max_q for _, _, n in items) and offsets == list(
            range(offsets[0], offsets[0] + max_q * len(items), max_q)
        ):
            g.tokens = slice(offsets[0], offsets[0] + max_q * len(items))
        else:
            # Padding query rows repeat a real token; they are computed and dropped.
            g.q_index = torch.tensor(
                [[off + min(j, n - 1) for j in range(max_q)] for _, off, n in items], device=dev
            )
            if any(n != max_q for _, _, n in items):
                g.q_valid = torch.tensor(
                    [[j < n for j in range(max_q)] for _, _, n in items], device=dev
                )
        first = items[0][0].block_table[:n_blocks]
        if len(items) == 1 and first == list(range(first[0], first[0] + n_blocks)):
            g.kv_block_range = (first[0], n_blocks)
        else:
            # Blocks past a sequence's table are padding: block 0, masked out.
            g.kv_blocks = torch.tensor(
                [b for s, _, _ in items for b in _padded_table(s.block_table, n_blocks)],
                device=dev,
            )
        if max_q > 1 or any(c != width for c in ctx):
            q_pos = torch.tensor(
                [[s.start_pos + j for j in range(max_q)] for s, _, _ in items], device=dev
            )
            visible = torch.arange(width, device=dev)[None, None, :] <= q_pos[:, :, None]
            g.mask = (
                torch.zeros(visible.shape, dtype=self.dtype, device=dev)
                .masked_fill_(~visible, float("-inf"))
                .unsqueeze(1)
            )
        return g
