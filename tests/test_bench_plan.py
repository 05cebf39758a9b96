"""The request plan: exact prompt lengths, shared prefixes, sessions, determinism, traces."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from servelab.bench.workloads.presets import PRESETS
from servelab.bench.workloads.prompts import PromptFactory
from servelab.bench.workloads.request_plan import LoadSpec, build_plan, iter_plan
from servelab.bench.workloads.spec import load_workload, parse_workload
from servelab.testing.tokenizers import tiny_tokenizer


def _sent_text(tok, r, endpoint):
    if endpoint == "chat" and r.tags.turn == 0:
        return tok.apply_chat_template([{"role": "user", "content": r.prompt}])
    return r.prompt


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_prompt_lengths_exact_real_tokenizer(smollm_tok, preset, endpoint):
    plan = build_plan(
        load_workload(preset),
        LoadSpec(rate=4, requests=12),
        1,
        tokenizer=smollm_tok,
        endpoint=endpoint,
        max_model_len=8192,
    )
    assert len({r.request_id for r in plan}) == len(plan)
    for r in plan:
        assert len(smollm_tok.encode(_sent_text(smollm_tok, r, endpoint))) == r.prompt_tokens
        assert r.prompt.isascii() and r.prompt[:1].strip()  # text, starting without a space
        assert r.max_tokens >= 1


@pytest.mark.parametrize("byte_level", [True, False])
def test_prompt_lengths_exact_small_tokenizers(byte_level):
    # A 320-token vocabulary splits most words into several tokens; without a
    # pre-tokenizer, merges cross word boundaries and the builder must correct itself.
    tok = tiny_tokenizer(byte_level)
    factory = PromptFactory(tok)
    import random

    rng = random.Random(0)
    for n in (1, 2, 3, 7, 31, 200, 900):
        for style in ("prose", "code", "question"):
            text = factory.segment(n, rng, style, " Ticket 123456.")
            assert len(tok.encode(text)) == n
    plan = build_plan(load_workload("mixed"), LoadSpec(rate=1, requests=10), 3, tokenizer=tok)
    for r in plan:
        assert len(tok.encode(r.prompt)) == r.prompt_tokens


def test_shared_prefixes_exactly_where_specified(smollm_tok):
    spec = parse_workload(
        {
            "classes": [
                {
                    "name": "doc",
                    "input": {"dist": "uniform", "min": 20, "max": 60},
                    "output": 4,
                    "prefix": [
                        {"name": "sys", "count": 1, "tokens": 40, "reuse": 1.0},
                        {"name": "doc", "count": 3, "tokens": 100, "reuse": 0.6},
                    ],
                },
                {"name": "plain", "input": 80, "output": 4},
            ]
        }
    )
    plan = build_plan(spec, LoadSpec(concurrency=2, requests=60), 7, tokenizer=smollm_tok)
    ids = {r.request_id: smollm_tok.encode(r.prompt) for r in plan}
    groups = {r.tags.prefix_group for r in plan}
    assert {"doc:sys0", "doc:sys0/doc0", "doc:sys0/doc1", "doc:sys0/doc2", None} <= groups
    for a, b in itertools.combinations(plan, 2):
        lcp = _lcp(ids[a.request_id], ids[b.request_id])
        pa, pb = a.tags.prefix_group, b.tags.prefix_group
        ga, gb = (pa or "").split(":")[-1], (pb or "").split(":")[-1]
        common = 0
        for x, y in zip(ga.split("/"), gb.split("/")):
            if not x or x != y:
                break
            common += 1
        if common == 0:
            assert lcp < 16, (pa, pb, lcp)  # not even one KV block
        else:
            shared = 40 + (100 if common == 2 else 0)
            assert lcp >= shared, (pa, pb, lcp)
            assert lcp < shared + 16  # the request's own text starts with a unique lead
    sharing = [r for r in plan if r.tags.prefix_group and r.tags.prefix_group.count("/") == 1]
    assert all(r.prefix_tokens == 140 for r in sharing)


def test_plan_is_deterministic_and_streams_are_independent(smollm_tok):
    spec = load_workload("chat")
    a = build_plan(spec, LoadSpec(rate=2, requests=20), 5, tokenizer=smollm_tok)
    b = build_plan(spec, LoadSpec(rate=2, requests=20), 5, tokenizer=smollm_tok)
    c = build_plan(spec, LoadSpec(rate=8, requests=20), 5, tokenizer=smollm_tok)
    d = build_plan(spec, LoadSpec(rate=2, requests=20), 6, tokenizer=smollm_tok)
    assert [r.to_dict() for r in a] == [r.to_dict() for r in b]
    assert [r.prompt for r in a] == [r.prompt for r in c]  # the rate moves only send times
    assert [r.send_time for r in a] != [r.send_time for r in c]
    assert [r.prompt for r in a] != [r.prompt for r in d]


def test_sessions_have_turns_and_think_times(smollm_tok):
    plan = build_plan(load_workload("agent"), LoadSpec(rate=1, requests=8), 0, tokenizer=smollm_tok)
    sessions: dict[str, list] = {}
    for r in plan:
        sessions.setdefault(r.tags.session_id, []).append(r)
    assert len(sessions) == 8
    for turns in sessions.values():
        assert [r.tags.turn for r in turns] == list(range(len(turns)))
        assert 2 <= len(turns) <= 4 and all(r.num_turns == len(turns) for r in turns)
        assert turns[0].send_time is not None
        assert all(r.send_time is None and r.think_time == pytest.approx(0.5) for r in turns[1:])
        assert turns[0].tags.prefix_group is not None
        assert all(r.tags.prefix_group is None for r in turns[1:])


def test_open_loop_stops_at_duration_and_closed_loop_streams(smollm_tok):
    plan = build_plan(load_workload("chat"), LoadSpec(rate=5, duration=4), 0, tokenizer=smollm_tok)
    first = [r.send_time for r in plan if r.tags.turn == 0]
    assert first[0] == 0.0 and max(first) <= 4.0 and first == sorted(first)
    with pytest.raises(ValueError, match="iter_plan"):
        build_plan(
            load_workload("chat"), LoadSpec(concurrency=2, duration=5), 0, tokenizer=smollm_tok
        )
    it = iter_plan(
        load_workload("batch"), LoadSpec(concurrency=2, duration=5), 0, tokenizer=smollm_tok
    )
    first_300 = list(itertools.islice(it, 300))
    assert len(first_300) == 300 and all(r.send_time is None for r in first_300)


def test_length_scale_and_context_clipping(smollm_tok):
    spec = parse_workload({"classes": [{"name": "x", "input": 1000, "output": 400}]})
    plan = build_plan(spec, LoadSpec(rate=1, requests=3, length_scale=0.5), 0, tokenizer=smollm_tok)
    assert all((r.prompt_tokens, r.max_tokens) == (500, 200) for r in plan)
    plan = build_plan(
        spec, LoadSpec(rate=1, requests=3), 0, tokenizer=smollm_tok, max_model_len=1024
    )
    assert all((r.prompt_tokens, r.max_tokens) == (768, 256) for r in plan)
    assert plan.info["clipped_to_context"] == {"inputs": 3, "outputs": 3}


def test_load_spec_errors_say_what_to_do():
    with pytest.raises(ValueError, match="not both"):
        LoadSpec(concurrency=2, rate=1, requests=1).validate()
    with pytest.raises(ValueError, match="--concurrency N, --rate R or --trace"):
        LoadSpec(requests=1).validate()
    with pytest.raises(ValueError, match="--requests N or --duration"):
        LoadSpec(rate=1).validate()
    with pytest.raises(ValueError, match="unknown --arrival"):
        LoadSpec(rate=1, requests=1, arrival="weibull").validate()


def test_load_from_flags_applies_the_rules_every_caller_shares():
    assert LoadSpec.from_flags() == LoadSpec(concurrency=1, requests=20)
    assert LoadSpec.from_flags(rate=2, duration=30) == LoadSpec(rate=2, duration=30)
    trace = LoadSpec.from_flags(trace="azure-2023-conv")
    assert (trace.concurrency, trace.rate, trace.requests) == (None, None, None)
    onoff = LoadSpec.from_flags(rate=2, on=5, off=10)
    assert (onoff.arrival, onoff.on, onoff.off) == ("onoff", 5, 10)
    assert LoadSpec.from_flags(rate=2, ramp_to=8).arrival == "ramp"
    assert LoadSpec.from_flags(rate=2, ramp_to=8, arrival="constant").arrival == "constant"
    swept = LoadSpec.from_flags(sweep=("rate", [0.5, 1, 2]))
    assert (swept.rate, swept.concurrency, swept.requests) == (0.5, None, 10)
    closed = LoadSpec.from_flags(sweep=("concurrency", [4.0, 16.0]))
    assert (closed.concurrency, closed.rate, closed.requests) == (4, None, 10)
    searched = LoadSpec.from_flags(search=True, requests=30)
    assert (searched.rate, searched.concurrency, searched.requests) == (1.0, None, 30)


def test_load_from_flags_refuses_what_does_not_go_together():
    with pytest.raises(ValueError, match="not both"):
        LoadSpec.from_flags(sweep=("rate", [1, 2]), search=True)
    with pytest.raises(ValueError, match="drop --concurrency"):
        LoadSpec.from_flags(concurrency=2, search=True)
    with pytest.raises(ValueError, match="inf cannot be swept or searched"):
        LoadSpec.from_flags(rate=float("inf"), search=True)
    with pytest.raises(ValueError, match="not both"):  # validated like any LoadSpec
        LoadSpec.from_flags(concurrency=2, rate=1)


# --------------------------------------------------------------------------- traces


def test_trace_replay_scaled_timing_and_lengths(smollm_tok, tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.0000000,374,44\n"
        "2023-11-16 18:15:47.5000000,9000,20\n"
        "2023-11-16 18:15:50.0000000,100,9000\n"
    )
    plan = build_plan(
        None,
        LoadSpec(trace=str(csv), time_scale=2.0, length_scale=0.5),
        0,
        tokenizer=smollm_tok,
        max_model_len=4096,
    )
    assert [r.send_time for r in plan] == pytest.approx([0.0, 3.0, 8.0])
    # 9000 * 0.5 inputs clip to 4096 - 10; a 4500-token output clips to 4095, leaving 1 input
    assert [(r.prompt_tokens, r.max_tokens) for r in plan] == [(187, 22), (4086, 10), (1, 4095)]
    for r in plan:
        assert len(smollm_tok.encode(r.prompt)) == r.prompt_tokens
    t = plan.info["trace"]
    assert t["format"] == "azure" and t["clipped_inputs"] == 2 and t["clipped_outputs"] == 1
    assert t["replayed"]["span_s"] == pytest.approx(8.0)


def test_trace_rate_sets_time_scale(smollm_tok):
    plan = build_plan(
        None,
        LoadSpec(trace="azure-2023-conv", rate=0.5, requests=200, length_scale=0.1),
        0,
        tokenizer=smollm_tok,
    )
    t = plan.info["trace"]
    orig = t["original"]["mean_rate"]
    assert t["time_scale"] == pytest.approx(orig / 0.5)
    times = np.array([r.send_time for r in plan])
    assert (times.size - 1) / times[-1] == pytest.approx(0.5, rel=0.5)


def test_mooncake_hash_ids_become_exact_shared_prefixes(smollm_tok, tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1600, "output_length": 5, "hash_ids": [1, 2, 3, 4]},
        {"timestamp": 100, "input_length": 1300, "output_length": 5, "hash_ids": [1, 2, 9]},
        {"timestamp": 250, "input_length": 700, "output_length": 5, "hash_ids": [7, 8]},
        {"timestamp": 300, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
    ]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plan = build_plan(None, LoadSpec(trace=str(path), length_scale=0.25), 0, tokenizer=smollm_tok)
    ids = [smollm_tok.encode(r.prompt) for r in plan]
    assert [len(x) for x in ids] == [400, 325, 175, 256]
    assert [r.send_time for r in plan] == pytest.approx([0.0, 0.1, 0.25, 0.3])
    assert _lcp(ids[0], ids[1]) >= 256 and _lcp(ids[0], ids[1]) < 256 + 16  # blocks 1, 2 shared
    assert _lcp(ids[0], ids[3]) == 256  # the whole of request 3
    assert _lcp(ids[0], ids[2]) < 16


def test_named_traces_ship_with_the_package_and_paths_still_work():
    from servelab.bench.workloads.traces import load_trace, trace_path

    for name, fmt, n in (
        ("azure-2023-conv", "azure", 19366),
        ("mooncake-synthetic", "mooncake", 3993),
    ):
        rows, got = load_trace(name)
        assert got == fmt and len(rows) == n and rows[0].time == 0.0
        assert load_trace(str(trace_path(name)))[0] == rows
    with pytest.raises(ValueError, match="azure-2023-conv, mooncake-synthetic"):
        load_trace("no-such-trace")
