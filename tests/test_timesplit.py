"""Where the time went (analyze.diagnosis.timesplit): every bar's parts add up to the figure it splits,
and the planted cause shows as its part; the speculation and KV hand-off figures
(analyze.server_side.phase_costs) count what the timelines hold."""

from __future__ import annotations

import statistics

import pytest
from rundirs import calm, unchunked_stalls

from servelab.analyze.answers import during_prefill
from servelab.analyze.diagnosis.timesplit import (
    PLAIN_STEPS,
    SPEC_STEPS,
    STEP_ADDED,
    STEP_ONE,
    TYPICAL_GAP,
    stall_split,
    step_split,
    token_split,
    ttft_split,
)
from servelab.analyze.server_side.phase_costs import acceptance, kv_transfers
from servelab.rundir import load_run
from servelab.vocab import SpecRecord


def _total(parts: dict[str, float]) -> float:
    return sum(parts.values())


def test_ttft_split_adds_up_to_the_mean_ttft(tmp_path):
    run = load_run(calm(tmp_path / "calm", seed=3))
    split = ttft_split([("a", [run])])
    ok = [r for r in run.records if r.ok and r.chunk_times]
    mean = statistics.fmean(r.ttft_intended for r in ok)
    ((label, parts),) = split.bars
    assert label == "a" and _total(parts) == pytest.approx(mean, rel=1e-6)
    assert parts["prefill"] > 0 and set(parts) <= set(split.parts)


def test_stall_split_names_the_prefill_and_adds_up(tmp_path):
    stalled = load_run(unchunked_stalls(tmp_path / "u", seed=1))
    calm_run = load_run(calm(tmp_path / "c", seed=1))
    split = stall_split([("unchunked", [stalled]), ("calm", [calm_run])], "chat", "rag")
    pop = during_prefill([r for r in stalled.records if r.ok], "chat", "rag")
    assert pop, "the scenario has chats decoding during a long prefill"
    parts = dict(split.bars)["unchunked"]
    assert _total(parts) == pytest.approx(statistics.fmean(r.max_itl for r in pop), rel=1e-6)
    # The long prompt is the cause of most of those streams' longest gap.
    assert parts["stall: prefill"] > parts[TYPICAL_GAP]
    # No rag prompt in the calm run: an empty bar, the same part names.
    assert dict(split.bars)["calm"] == {}


def test_step_split_is_the_first_step_and_what_the_others_add(tmp_path):
    one = load_run(calm(tmp_path / "one", seed=0))
    slow = load_run(calm(tmp_path / "slow", seed=0, slowdown=2.0))
    split = step_split([("c1", [one]), ("c8", [slow])])
    a, b = (dict(split.bars)[k] for k in ("c1", "c8"))
    assert a[STEP_ADDED] == 0 and b[STEP_ONE] == pytest.approx(a[STEP_ONE])
    steps = [s.end - s.start for s in slow.steps if s.decode_seqs and not s.prefill_tokens]
    assert _total(b) == pytest.approx(statistics.fmean(steps))
    assert b[STEP_ADDED] > 0.5 * a[STEP_ONE]


def test_token_split_separates_speculative_steps(tmp_path):
    run = load_run(calm(tmp_path / "s", seed=2))
    # Plant speculation: every request's decode steps verified drafts.
    steps_of: dict[str, list[int]] = {}
    for s in run.steps:
        for rid in s.decode:
            steps_of.setdefault(rid, []).append(s.step_id)
    for tl in run.timelines.values():
        tl.spec = [
            SpecRecord(step_id=i, proposed=4, accepted=2) for i in steps_of.get(tl.request_id, [])
        ]
    plain = load_run(calm(tmp_path / "p", seed=2))
    split = token_split([("on", [run]), ("off", [plain])], ["chat", "chat"])
    on, off = dict(split.bars)["on (chat)"], dict(split.bars)["off (chat)"]
    assert on[SPEC_STEPS] > 0 and on.get(PLAIN_STEPS, 0.0) == 0.0
    assert off[PLAIN_STEPS] > 0 and off.get(SPEC_STEPS, 0.0) == 0.0
    # Per token: the decode time of each request over its tokens after the first.
    per_token = [
        tl.decode_time / (tl.output_tokens - 1)
        for tl in plain.timelines.values()
        if tl.output_tokens > 1 and tl.decode_time > 0
    ]
    assert _total(off) == pytest.approx(statistics.fmean(per_token), rel=1e-6)

    acc = acceptance([run], "chat")
    assert acc is not None and acc.rate == pytest.approx(0.5)
    assert acc.mean_accepted_length == pytest.approx(3.0)
    assert acceptance([plain], "chat") is None and acceptance([run], "rag") is None


def test_kv_transfers_reads_the_hand_offs(tmp_path):
    run = load_run(calm(tmp_path / "d", seed=4))
    assert kv_transfers([run]) is None  # colocated: nothing handed over
    for k, tl in enumerate(run.timelines.values()):
        tl.kv_transfer = {"seconds": 0.01 * (k % 3 + 1), "bytes": 2_000_000, "handoff_wait": 0.005}
    kv = kv_transfers([run])
    assert kv is not None and kv["transfers"] == len(run.timelines)
    assert kv["transfer_ms_p50"] == pytest.approx(20.0) and kv["mb_p50"] == pytest.approx(2.0)
    shares = [
        tl.kv_transfer["seconds"] / (tl.first_token - tl.arrival) for tl in run.timelines.values()
    ]
    assert kv["share_of_ttft_p50"] == pytest.approx(statistics.median(shares))
