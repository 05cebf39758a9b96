"""The engine core's step loop hands freed heap back to the OS: after work, at most once a
period, and never while idle with nothing done (model-free engine, virtual clock)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import zmq
from engine_fakes import FakeClock, FakeExecutor

from servelab.engine.engine import LLMEngine
from servelab.engine.engine_config import EngineConfig
from servelab.server import engine_core, ipc


class _Core(engine_core.EngineCore):
    """Stops after ``iterations`` loop turns with nothing left to do; polls without waiting."""

    def __init__(self, *a: Any, clock: FakeClock, idle_advance: float, iterations: int) -> None:
        super().__init__(*a)
        self.clock = clock
        self.idle_advance = idle_advance
        self.iterations = iterations

    def idle_poll_ms(self) -> int:
        return 0

    def after_batch(self) -> None:
        if not self.engine.has_unfinished():
            self.clock.now += self.idle_advance
            self.iterations -= 1
            self._stop = self.iterations <= 0


def _run(max_tokens: int, idle_advance: float, iterations: int, monkeypatch) -> list[float]:
    clock = FakeClock()
    trims: list[float] = []
    monkeypatch.setattr(engine_core, "MALLOC_TRIM", lambda pad: trims.append(clock.now))
    ex = FakeExecutor(vocab_size=1000, max_model_len=4096, clock=clock)
    engine = LLMEngine(ex, EngineConfig(block_size=16, num_kv_blocks=512), clock=clock)
    ctx = zmq.Context()
    inputs, feed = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    outputs, sink = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    inputs.bind("inproc://in")
    feed.connect("inproc://in")
    sink.bind("inproc://out")
    outputs.connect("inproc://out")
    if max_tokens:
        sampling = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
        feed.send(ipc.encode(ipc.AddRequest("r", [1, 2, 3], sampling, 0, 0.0)))
    loop = _Core(
        engine,
        inputs,
        outputs,
        engine_core.os.getppid(),
        clock=clock,
        idle_advance=idle_advance,
        iterations=iterations,
    )
    try:
        loop.run()
    finally:
        ctx.destroy(linger=0)
    return trims


def test_a_busy_core_trims_once_a_period(monkeypatch: pytest.MonkeyPatch) -> None:
    # 2,000 steps of ~11 virtual ms: about 22 s of work, then three idle turns. The first
    # step is trimmed after at once (it follows loading), then one trim per 10 s.
    trims = _run(2000, idle_advance=0.0, iterations=3, monkeypatch=monkeypatch)
    assert len(trims) == 3 and trims[0] < 0.1
    assert all(b - a >= engine_core._TRIM_PERIOD_S for a, b in zip(trims, trims[1:], strict=False))


def test_work_is_trimmed_after_once_the_core_is_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    # 1,000 steps (~11 s), then idle turns 20 s apart: the first step's trim, one for the
    # rest of the work on the first idle turn, none for the idling after it.
    trims = _run(1000, idle_advance=20.0, iterations=4, monkeypatch=monkeypatch)
    assert len(trims) == 3 and trims[2] > 20


def test_an_idle_core_never_trims(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _run(0, idle_advance=20.0, iterations=4, monkeypatch=monkeypatch) == []


_STEPS = """
import resource, sys
from servelab.server.heap import keep_step_buffers
if sys.argv[1] == "keep":
    keep_step_buffers()
def step():  # three activations of a layer, freed together
    bufs = [bytearray(20 * 2**20) for _ in range(3)]
    del bufs
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(engine_core.MALLOC_TRIM is None, reason="glibc's heap controls are not here")
def test_steps_reuse_their_heap_instead_of_faulting_it_in_again() -> None:
    """glibc's own thresholds trim the heap at twice the biggest buffer freed, so a step that
    frees several such buffers gives the pages back and faults them in again next time;
    the core's policy keeps them until its periodic trim."""

    def faults(policy: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", _STEPS, policy], capture_output=True, text=True, check=True
        )
        return int(out.stdout)

    default, kept = faults("default"), faults("keep")
    assert default > 10 * 3 * 20 * 2**20 // 4096 // 2, default  # re-faulted most pages each step
    assert kept < default // 20, (kept, default)
