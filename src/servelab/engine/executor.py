"""The executor interface: "run this batch plan, return the sampled tokens and the step time"."""

from __future__ import annotations

from typing import Protocol

from servelab.engine.batch_plan import BatchPlan, StepOutput


class Executor(Protocol):
    """Runs batch plans. Implemented by the torch model runner and the simulator.

    Contract:
    - ``kv_block_bytes`` is the memory one KV block takes (all layers, K and V), so
      the engine can size the pool from a memory budget.
    - ``allocate_kv(num_blocks, block_size)`` is called once before any ``execute``.
    - ``execute(plan)`` runs one step. Blocks named in block tables are owned by the
      caller; the executor only reads and writes their contents.
    - ``copy_blocks``/``read_blocks``/``write_blocks`` are only needed for
      speculative roll-back and disaggregated transfer; executors may raise
      NotImplementedError.
    - ``max_model_len`` and ``eos_token_ids`` describe the model.
    - ``draft_proposer(spec, config)`` (optional) builds a proposer that runs a model beside
      this one (speculative methods ``draft`` and ``self-draft``); an executor without it
      supports ``ngram`` only. The engine layer never loads a model itself.
    """

    max_model_len: int
    eos_token_ids: list[int]

    def kv_block_bytes(self, block_size: int) -> int: ...

    def allocate_kv(self, num_blocks: int, block_size: int) -> None: ...

    def execute(self, plan: BatchPlan) -> StepOutput: ...
