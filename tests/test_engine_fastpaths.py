"""The engine's fast paths (the simulator's speed) keep the slow paths' answers."""

from __future__ import annotations

import gc
from decimal import Decimal
from fractions import Fraction

import pytest
from engine_fakes import FakeClock, FakeExecutor

from servelab.engine.engine import LLMEngine
from servelab.engine.engine_config import EngineConfig
from servelab.engine.kv.kv_cache import KVCacheManager
from servelab.engine.kv.kv_cache_plain import ROOT_HASH
from servelab.sim.costs.executor import VirtualClock
from servelab.sim.loop.simulation import SimRequest, Simulation
from servelab.sim.sim_target import roofline_target

VOCAB = 1000


def engine() -> LLMEngine:
    clock = FakeClock()
    ex = FakeExecutor(vocab_size=VOCAB, max_model_len=512, clock=clock)
    return LLMEngine(ex, EngineConfig(block_size=4, num_kv_blocks=64), clock=clock)


class _Id(int):
    """An int subclass: accepted like an int, but not by the exact-type fast check."""


@pytest.mark.parametrize(
    ("ids", "named"),
    [
        ([1, -1], "[-1]"),
        ([3, 2.0, 4], "[2.0]"),
        ([VOCAB, 1], f"[{VOCAB}]"),
        ([1, "7"], "['7']"),
        ([1, None], "[None]"),
        ([1, Decimal(2)], "[Decimal('2')]"),
        ([Fraction(3, 1), 1], "[Fraction(3, 1)]"),
    ],
)
def test_a_prompt_the_fast_check_refuses_is_judged_token_by_token(ids, named) -> None:
    with pytest.raises(ValueError, match="invalid ids") as err:
        engine().add_request("a", prompt_token_ids=ids)
    assert named in str(err.value)


def test_int_subclasses_and_bools_stay_valid_token_ids() -> None:
    e = engine()
    e.add_request("a", prompt_token_ids=[_Id(3), True, 5])
    assert e.get_request("a").prompt_token_ids == [3, 1, 5]


def test_memoised_chain_hashes_follow_the_documented_formula() -> None:
    # Disaggregated workers compare these hashes across processes: the memo must not
    # change them, however the calls that fill it are split.
    kv = KVCacheManager(16, 4)
    tokens = list(range(100, 118))
    kv.lookup("a", tokens[:9])  # fills two blocks
    got = kv.chain_hashes("a", tokens, 4)
    parent, want = ROOT_HASH, []
    for i in range(4):
        parent = hash((parent, tuple(tokens[4 * i : 4 * i + 4])))
        want.append(parent)
    assert got[:4] == want


def test_decode_allocation_inside_the_last_block_changes_nothing() -> None:
    kv = KVCacheManager(8, 4)
    assert kv.allocate("a", 5)
    table, free = list(kv.block_table("a")), kv.num_free_blocks
    assert kv.allocate("a", 8)
    assert kv.block_table("a") == table and kv.num_free_blocks == free
    assert kv.allocate("a", 9)
    assert kv.block_table("a")[:2] == table and kv.num_free_blocks == free - 1
    kv.check_invariants()


def test_the_executor_reads_the_live_block_table_within_the_step() -> None:
    target = roofline_target(
        "h200", "llama-3.1-8b", engine_config=EngineConfig(num_kv_blocks=64, block_size=4)
    )
    seen: list[bool] = []
    eng, ex = target.factory(VirtualClock(0.0), 0)
    execute = ex.execute

    def checking_execute(plan):
        for s in plan.seqs:
            table = eng.kv_cache.block_table(s.request_id)
            seen.append(s.block_table == table and len(table) * 4 >= s.start_pos + 1)
        return execute(plan)

    ex.execute = checking_execute
    eng.add_request("a", prompt_token_ids=list(range(1, 11)))
    while eng.has_unfinished():
        eng.step()
    assert seen and all(seen)


@pytest.mark.parametrize("enabled", [True, False])
def test_the_simulation_pauses_cyclic_gc_only_while_it_runs(enabled: bool) -> None:
    target = roofline_target("h200", "llama-3.1-8b")
    during: list[bool] = []
    reqs = [SimRequest(f"r{i}", 0.01 * i, [i + 1] * 40, 5) for i in range(5)]
    sim = Simulation(target.factory, reqs, step_sink=lambda _: during.append(gc.isenabled()))
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        sim.run()
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
    assert during and not any(during)


def test_what_the_run_keeps_waits_for_a_full_collection() -> None:
    """Resuming the collector must not walk everything the run kept at the next allocation:
    the survivors move to the oldest generation. A caller's frozen objects stay frozen."""
    target = roofline_target("h200", "llama-3.1-8b")
    reqs = [SimRequest(f"r{i}", 0.01 * i, [i + 1] * 40, 5) for i in range(5)]
    was = gc.isenabled()
    gc.enable()
    gc.collect()  # generation counts at 0: no collection of its own moves the survivors
    gc.freeze()
    frozen = gc.get_freeze_count()
    try:
        res = Simulation(target.factory, reqs).run()
        assert gc.get_freeze_count() == frozen
        gc.unfreeze()
        res = Simulation(target.factory, reqs).run()
        kept = res.timelines[0]
        assert any(o is kept for o in gc.get_objects(generation=2))
    finally:
        gc.unfreeze()
        (gc.enable if was else gc.disable)()
