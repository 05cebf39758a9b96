"""The discrete-event loop over the engine's own scheduler and KV cache."""

from __future__ import annotations

import itertools
import random

import pytest

from servelab.engine.engine import LLMEngine
from servelab.engine.engine_config import EngineConfig
from servelab.engine.kv.kv_cache import KVCacheManager
from servelab.engine.scheduler import Scheduler
from servelab.sim.costs.executor import VirtualClock
from servelab.sim.costs.roofline import Efficiency
from servelab.sim.loop.links import parse_link
from servelab.sim.loop.simulation import T0, SimRequest, Simulation, Topology
from servelab.sim.sim_target import roofline_target
from servelab.vocab import RequestTags


def _target(**cfg):
    config = EngineConfig(**{"max_num_seqs": 32, "max_num_batched_tokens": 1024, **cfg})
    return roofline_target("h100", "llama-3.1-8b", engine_config=config)


def _requests(n=60, rate=20.0, seed=0, shared_prefix=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 30000) for _ in range(shared_prefix)]
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        prompt = prefix + [rng.randrange(1, 30000) for _ in range(rng.randint(50, 600))]
        out.append(SimRequest(f"r{i}", t, prompt, rng.randint(5, 80)))
    return out


def _fingerprint(res):
    return [(r.request_id, r.actual_send, tuple(r.chunk_times), r.done) for r in res.records]


def test_replicas_are_the_engines_own_classes():
    clock = VirtualClock()
    engine, ex = _target().factory(clock, 0)
    assert type(engine) is LLMEngine
    assert type(engine.scheduler) is Scheduler
    assert type(engine.kv_cache) is KVCacheManager
    assert engine.executor is ex and engine.clock is clock


def test_the_same_inputs_give_the_same_run():
    a = Simulation(_target().factory, _requests(), network_delay=0.002).run()
    b = Simulation(_target().factory, _requests(), network_delay=0.002).run()
    assert _fingerprint(a) == _fingerprint(b)
    c = Simulation(_target().factory, _requests(seed=1), network_delay=0.002).run()
    assert _fingerprint(a) != _fingerprint(c)


def test_every_request_completes_with_its_output_length_and_a_consistent_timeline():
    reqs = _requests()
    res = Simulation(_target().factory, reqs, network_delay=0.005).run()
    assert len(res.records) == len(reqs)
    by_id = {t.request_id: t for t in res.timelines}
    for req, rec in zip(reqs, res.records):
        assert rec.ok and rec.status == 200
        assert rec.output_tokens == req.max_tokens == sum(rec.chunk_tokens)
        assert rec.actual_send == pytest.approx(T0 + req.send_time)
        tl = by_id[req.request_id]
        # The client sees every token one network delay after the engine emitted it.
        assert rec.chunk_times[0] == pytest.approx(tl.first_token + 0.005)
        assert rec.done == pytest.approx(tl.finished + 0.005)
        assert tl.arrival == pytest.approx(rec.actual_send + 0.005)
        assert rec.ttft > 0.01  # two network delays plus a prefill step
    # Steps of one replica never overlap.
    assert all(a["end"] <= b["start"] + 1e-12 for a, b in itertools.pairwise(res.steps))


def test_a_network_delay_shifts_ttft_by_the_round_trip():
    reqs = _requests(n=5, rate=0.5)  # sparse: no queueing
    near = Simulation(_target().factory, reqs, network_delay=0.0).run()
    far = Simulation(_target().factory, reqs, network_delay=0.050).run()
    for a, b in zip(near.records, far.records):
        assert b.ttft - a.ttft == pytest.approx(0.100, abs=1e-9)
        assert b.itls == pytest.approx(a.itls)


def test_closed_loop_concurrency_limit_is_respected():
    reqs = [SimRequest(f"r{i}", 0.0, [7] * 200, 20) for i in range(12)]
    res = Simulation(_target().factory, reqs, max_concurrency=3).run()
    events = sorted([(r.actual_send, 1) for r in res.records] + [(r.done, -1) for r in res.records])
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    assert peak == 3
    assert max(r.send_lag for r in res.records) > 0  # later requests waited for a slot


def test_sessions_wait_for_the_previous_turn():
    reqs = [
        SimRequest("t0", 0.0, [5] * 100, 10, tags=RequestTags(session_id="s")),
        SimRequest(
            "t1",
            0.0,
            [5] * 150,
            10,
            after="t0",
            think_time=1.0,
            tags=RequestTags(session_id="s", turn=1),
        ),
    ]
    res = Simulation(_target().factory, reqs).run()
    t0, t1 = res.records
    assert t1.actual_send == pytest.approx(t0.done + 1.0)


def test_a_session_keeps_its_concurrency_slot_and_non_streamed_output_comes_at_once():
    reqs = [
        SimRequest("a0", 0.0, [5] * 100, 10, tags=RequestTags(session_id="a")),
        SimRequest(
            "a1",
            0.0,
            [5] * 150,
            10,
            after="a0",
            think_time=0.5,
            tags=RequestTags(session_id="a", turn=1),
        ),
        SimRequest("b0", 0.0, [6] * 100, 10, tags=RequestTags(stream=False)),
    ]
    res = Simulation(_target().factory, reqs, max_concurrency=1).run()
    a0, a1, b0 = res.records
    assert a1.actual_send == pytest.approx(a0.done + 0.5)
    assert b0.actual_send == pytest.approx(a1.done)  # b waited for the whole session
    assert b0.chunk_times == [b0.done] and b0.chunk_tokens == [10] and not b0.stream


def test_a_failed_turn_skips_the_rest_of_its_session():
    reqs = [
        SimRequest("a0", 0.0, [5] * 2000, 10, tags=RequestTags(session_id="a")),
        SimRequest("a1", 0.0, [5] * 10, 10, after="a0", tags=RequestTags(session_id="a", turn=1)),
        SimRequest("a2", 0.0, [5] * 10, 10, after="a1", tags=RequestTags(session_id="a", turn=2)),
        SimRequest("b0", 0.0, [6] * 10, 10),
    ]
    res = Simulation(_target(max_model_len=1024).factory, reqs, max_concurrency=1).run()
    a0, a1, a2, b0 = res.records
    assert a0.status == 400
    assert a1.error.startswith("skipped") and a2.error.startswith("skipped")
    assert not a1.chunk_times and b0.ok


def test_a_request_the_engine_rejects_becomes_a_400_record():
    too_long = SimRequest("big", 0.0, [3] * 2000, 100)
    ok = SimRequest("ok", 0.0, [3] * 20, 5)
    res = Simulation(_target(max_model_len=1024).factory, [too_long, ok]).run()
    big, fine = res.records
    assert big.status == 400 and "max_model_len" in big.error and not big.chunk_times
    assert fine.ok


def test_more_replicas_cut_queueing_under_overload():
    reqs = _requests(n=120, rate=60.0)
    one = Simulation(_target().factory, reqs).run()
    four = Simulation(_target().factory, reqs, Topology(replicas=4, router="least-loaded")).run()

    def p50(res):
        return sorted(r.ttft for r in res.records)[len(res.records) // 2]

    assert p50(four) < p50(one)
    assert {s["replica"] for s in four.steps} == {0, 1, 2, 3}


def test_prefix_aware_routing_raises_the_cache_hit_rate():
    reqs = []
    rng = random.Random(3)
    groups = [[rng.randrange(1, 30000) for _ in range(512)] for _ in range(6)]
    used = set()
    for i in range(80):
        g = rng.randrange(6)
        used.add(g)
        reqs.append(
            SimRequest(
                f"r{i}", i * 0.05, groups[g] + [rng.randrange(1, 30000) for _ in range(32)], 8
            )
        )

    def hits(router):
        res = Simulation(_target().factory, reqs, Topology(replicas=4, router=router)).run()
        return sum(r["stats"]["prefix_cache_hits"] for r in res.replicas)

    # Prefix-aware: only each group's first request misses; round-robin: one miss per replica.
    best = (len(reqs) - len(used)) * 512
    assert hits("prefix-aware") == best
    assert hits("round-robin") < best - 512 * len(used)


def test_disaggregated_prefill_decode_with_kv_transfer():
    reqs = _requests(n=40, rate=10.0)
    target = _target()
    topo = Topology(prefill=1, decode=2, link=parse_link("ethernet"))
    res = Simulation(target.factory, reqs, topo, kv_bytes_per_token=target.kv_bytes_per_token).run()
    roles = {s["role"] for s in res.steps}
    assert roles == {"prefill", "decode"}
    for req, rec in zip(reqs, res.records):
        assert rec.ok and rec.output_tokens == req.max_tokens == sum(rec.chunk_tokens)
    # The decode pool never ran a prompt-sized step: its prefill chunks cost one token each.
    prefill_steps = [s for s in res.steps if s["role"] == "prefill"]
    assert all(s["decode_seqs"] == 0 for s in prefill_steps)
    # The first gap includes the KV transfer: 1 GB/s-class links show up in ITL.
    slow = Simulation(
        target.factory,
        reqs,
        Topology(prefill=1, decode=2, link=parse_link("1GB/s,1ms")),
        kv_bytes_per_token=target.kv_bytes_per_token,
    ).run()

    def first_gap(res):
        return sum(r.itls[0] for r in res.records if r.itls)

    assert first_gap(slow) > first_gap(res)


def test_bad_topologies_say_what_to_do():
    with pytest.raises(ValueError, match="link"):
        Simulation(_target().factory, [], Topology(prefill=1, decode=1))
    with pytest.raises(ValueError, match="prefill"):
        Simulation(_target().factory, [], Topology(prefill=1, decode=0, link=parse_link("ib")))
    with pytest.raises(ValueError, match="router"):
        Simulation(_target().factory, [], Topology(replicas=2, router="random"))


def test_efficiency_changes_move_latency_the_right_way():
    reqs = _requests(n=30, rate=5.0)
    fast = roofline_target("h100", "llama-3.1-8b", efficiency=Efficiency(mbu=0.9))
    slow = roofline_target("h100", "llama-3.1-8b", efficiency=Efficiency(mbu=0.3))

    def itl(t):
        return sum(x for r in Simulation(t.factory, reqs).run().records for x in r.itls)

    assert itl(slow) > 2 * itl(fast)


def test_decode_work_is_the_work_of_a_decode_plan():
    from servelab.engine.batch_plan import BatchPlan, ScheduledSeq
    from servelab.engine.sampling_params import SamplingParams
    from servelab.sim.costs.work import decode_work, work_of_plan

    rng = random.Random(3)
    starts = [rng.randrange(0, 130_000) for _ in range(300)]
    seqs = [ScheduledSeq(f"r{i}", [7], s, [], True, SamplingParams()) for i, s in enumerate(starts)]
    assert decode_work(len(starts), sum(starts)) == work_of_plan(BatchPlan(0, seqs))


def test_decode_tokens_are_the_tokens_execute_samples():
    from servelab.engine.batch_plan import BatchPlan, ScheduledSeq
    from servelab.engine.sampling_params import SamplingParams

    ex = _target().make_executor(VirtualClock(T0))
    ex._placeholders = [5, 6, 7]
    sampled = [
        ex.execute(
            BatchPlan(k, [ScheduledSeq("a", [1], 10 + k, [], True, SamplingParams(), 4 + k)])
        ).sampled["a"][0]
        for k in range(8)
    ]
    assert ex.decode_tokens(4, 8) == sampled


def test_decode_bursts_change_nothing_with_shared_prefixes_and_several_placeholders():
    """Bursts register the blocks they fill with the tokens the executor samples: with a
    shared prefix, three placeholder ids and two replicas, every record, timeline, step and
    counter matches the step-by-step run."""
    import dataclasses

    target = dataclasses.replace(_target(num_kv_blocks=400), placeholder_ids=[5, 6, 7])
    reqs = _requests(n=80, rate=30.0, shared_prefix=64)

    def run(bursts):
        return Simulation(
            target.factory, reqs, Topology(2, router="least-loaded"), decode_bursts=bursts
        ).run()

    fast, ref = run(True), run(False)
    assert fast.num_burst_steps > 0 and ref.num_burst_steps == 0
    assert fast.records == ref.records
    assert [t.to_dict() for t in fast.timelines] == [t.to_dict() for t in ref.timelines]
    assert fast.steps == ref.steps
    assert fast.replicas == ref.replicas
    assert any(r["stats"]["prefix_cache_hits"] for r in fast.replicas)
