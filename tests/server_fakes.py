"""Engine-core factories the server tests pass to ``serve`` by name (``server_fakes:...``).

The server's core and worker processes import them from this directory, so whoever passes
one puts this directory on the children's PYTHONPATH (``server_helpers.with_tests_on_pythonpath``).

- ``fake_engine``: the real LLMEngine (scheduler, KV cache, detokenizer, timelines) and the
  real tokenizer of the tiny model, over the engine tests' FakeExecutor instead of torch,
  with a small sleep per step so that requests overlap as they do with a model.
- ``faulty_engine``: a disaggregated worker on the real tiny model, with faults chosen by
  request id.
"""

from __future__ import annotations

import time
from typing import Any

STEP_SLEEP_S = 0.003  # fake_engine: step time, so that requests overlap
SLOW_STEP_S = 0.01  # faulty_engine: decode step time, so requests are in flight when killed


def fake_engine(cfg: Any) -> Any:
    """Engine-core factory: real engine and tokenizer, fake executor (see the module doc)."""
    from engine_fakes import FakeExecutor

    from servelab.engine.engine import LLMEngine
    from servelab.engine.engine_config import EngineConfig
    from servelab.modelcore.tokenizer import Tokenizer

    class SleepyExecutor(FakeExecutor):
        def execute(self, plan: Any) -> Any:
            time.sleep(STEP_SLEEP_S)
            return super().execute(plan)

    tok = Tokenizer.from_model(cfg.model)
    executor = SleepyExecutor(
        vocab_size=tok.vocab_size, max_model_len=512, eos_token_ids=tok.eos_token_ids
    )
    return LLMEngine(executor, EngineConfig(**cfg.engine), tokenizer=tok)


def faulty_engine(cfg: Any) -> Any:
    """Worker engine factory: the real tiny model, with faults chosen by request id.

    ``fail-send-*``: the prefill side's transport refuses; ``lose-*``: the payload is never
    delivered (the decode side's reservation times out); every decode step takes
    SLOW_STEP_S, and a prefill step holding a ``slow-*`` request takes 1 s.
    """
    from servelab.server.disagg.worker_engine import DisaggEngine, TransferError
    from servelab.server.engine_core import build_engine

    class Faulty(DisaggEngine):
        def send_kv(self, request_id: str, skip: int, send: Any, *workers: int) -> Any:
            if request_id.startswith("fail-send"):

                def send(header: Any, blocks: Any) -> int:
                    raise TransferError("injected: the link is down")

            elif request_id.startswith("lose"):

                def send(header: Any, blocks: Any) -> int:
                    return header.nbytes

            return super().send_kv(request_id, skip, send, *workers)

        def step(self) -> Any:
            if self.role == "decode" and self.scheduler.running:
                time.sleep(SLOW_STEP_S)
            if self.role == "prefill" and any(
                r.request_id.startswith("slow")
                for r in [*self.scheduler.running, *self.scheduler.waiting]
            ):
                time.sleep(1.0)
            return super().step()

    return build_engine(cfg, Faulty)
