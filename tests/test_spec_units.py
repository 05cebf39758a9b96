"""Speculative decoding's pure-Python parts: config, draft-length policy, draft limits, KV
roll-back, the server flag and the Prometheus counters."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from servelab.cli import app
from servelab.engine.engine_config import EngineConfig
from servelab.engine.kv.kv_cache import KVCacheManager
from servelab.engine.kv.kv_cache_plain import PlainKVCache
from servelab.engine.request import Request
from servelab.engine.sampling_params import SamplingParams
from servelab.engine.spec.decoder import draft_limit
from servelab.engine.spec.policy import MAX_SKIP_STEPS, DraftLengthPolicy
from servelab.engine.spec.spec_config import SpeculativeConfig, parse_speculative_config
from servelab.server.metrics import ServerMetrics
from servelab.server.server_args import ServerArgs
from servelab.vocab import FinishReason, RequestTimeline, SpecRecord

# ---- config ----


def test_config_defaults_and_round_trip() -> None:
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.adaptive) == (2, 4, True)
    assert SpeculativeConfig.from_dict(c.to_dict()) == c
    assert c.to_dict() == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
        "adaptive": True,
    }
    only_max = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1}
    )
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (1, 1)
    d = SpeculativeConfig.from_dict({"method": "draft", "num_speculative_tokens": 3, "model": "m"})
    assert d.to_dict() == {
        "method": "draft",
        "num_speculative_tokens": 3,
        "model": "m",
        "adaptive": True,
    }
    s = SpeculativeConfig.from_dict(
        {"method": "self-draft", "num_speculative_tokens": 3, "num_layers": 8, "adaptive": False}
    )
    assert (s.num_layers, s.adaptive) == (8, False)
    # The engine config carries the JSON form through asdict() (the IPC hop).
    cfg = EngineConfig(speculative_config=s.to_dict())
    assert EngineConfig(**dataclasses.asdict(cfg)).speculative() == s


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("{nope", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"num_speculative_tokens": 4}', "method None is not known"),
        ('{"method": "eagle", "num_speculative_tokens": 4}', "use one of ngram, draft, self-draft"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "positive integer"),
        ('{"method": "ngram", "num_speculative_tokens": 99}', "at most 16"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "positive integer"),
        (
            (
                '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, '
                '"prompt_lookup_max": 2}'
            ),
            "must not exceed",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}',
            "'ngram' takes no model",
        ),
        ('{"method": "draft", "num_speculative_tokens": 2}', 'needs "model"'),
        ('{"method": "self-draft", "num_speculative_tokens": 2}', "num_layers is required"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}', "true or false"),
    ],
)
def test_bad_configs_say_what_is_wrong(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        parse_speculative_config(text)


def test_server_flag_reaches_the_engine_config() -> None:
    text = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5})
    args = ServerArgs(speculative_config=text)
    args.validate()
    assert args.engine_config().speculative() == SpeculativeConfig(
        "ngram", 3, prompt_lookup_min=2, prompt_lookup_max=5
    )
    assert ServerArgs().engine_config().speculative_config is None
    with pytest.raises(ValueError, match="--disaggregated"):
        ServerArgs(speculative_config=text, disaggregated=True).validate()


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ('{"method": "medusa", "num_speculative_tokens": 2}', "is not known"),
        ("not json", "not valid JSON"),
        ('{"method": "draft", "num_speculative_tokens": 2, "model": "no-such"}', "known names"),
    ],
)
def test_bad_flag_exits_2_with_a_message(value: str, needle: str) -> None:
    result = CliRunner().invoke(app, ["serve", "--speculative-config", value])
    assert result.exit_code == 2
    assert needle in result.output


# ---- policy ----


def test_policy_grows_shrinks_and_backs_off() -> None:
    p = DraftLengthPolicy(num_speculative_tokens=8)
    assert p.next_length("r") == 8
    p.observe("r", 8, 3)  # paid, partly accepted: one more than accepted
    assert p.next_length("r") == 4
    p.observe("r", 4, 4)  # all accepted: doubles, capped at k
    assert p.next_length("r") == 8
    p.observe("r", 8, 1)  # did not pay: a skipped step, then one more than accepted
    assert [p.next_length("r") for _ in range(2)] == [0, 2]
    p.observe("r", 2, 0)  # a second failure in a row: four steps skipped
    assert [p.next_length("r") for _ in range(5)] == [0, 0, 0, 0, 1]
    for _ in range(10):  # keeps failing: the pause grows, but is capped
        p.observe("r", 1, 0)
    skipped = 0
    while p.next_length("r") == 0:
        skipped += 1
    assert skipped == MAX_SKIP_STEPS
    p.observe("r", 1, 1)  # all accepted resets the backoff
    p.observe("r", 2, 0)
    assert [p.next_length("r") for _ in range(2)] == [0, 1]
    p.remove("r")
    assert p.next_length("r") == 8
    fixed = DraftLengthPolicy(4, adaptive=False)
    fixed.observe("x", 4, 0)
    fixed.observe("x", 4, 0)
    assert fixed.next_length("x") == 4


# ---- draft limits ----


def _request(prompt_len: int, outputs: int, **sp: object) -> Request:
    req = Request("r", list(range(1, prompt_len + 1)), SamplingParams(**sp), [0], 0.0)
    req.token_ids += [7] * outputs
    return req


def test_draft_limit_keeps_verification_inside_the_request() -> None:
    # 10 of 16 tokens out: at most 5 drafts (+ 1 bonus = the 6 left).
    assert draft_limit(_request(4, 10, max_tokens=16), max_model_len=100) == 5
    assert draft_limit(_request(4, 15, max_tokens=16), max_model_len=100) == 0
    # The context: 4 + 10 tokens in a 20-token context leave room for 5 drafts + bonus.
    assert draft_limit(_request(4, 10, max_tokens=100), max_model_len=20) == 5
    # Before min_tokens EOS is banned at every row, so drafts stop where the ban ends.
    assert draft_limit(_request(4, 2, max_tokens=16, min_tokens=5), max_model_len=100) == 2
    # ... unless nothing is banned (ignore_eos and no stop ids).
    assert draft_limit(_request(4, 2, max_tokens=16, min_tokens=5, ignore_eos=True), 100) == 13


# ---- KV roll-back ----


@pytest.mark.parametrize("cache", [KVCacheManager, PlainKVCache])
def test_trim_frees_only_rejected_blocks_and_keeps_hashes_right(cache) -> None:
    kv = cache(num_blocks=8, block_size=4, enable_prefix_caching=True)
    tokens = list(range(10))
    assert kv.allocate("a", 10 + 5)  # 10 verified positions + 5 draft positions: 4 blocks
    table = list(kv.block_table("a"))
    assert len(table) == 4
    assert kv.trim("a", 10) == 1  # positions 12.. only held drafts
    assert kv.block_table("a") == table[:3]
    assert kv.ref_count(table[3]) == 0 and kv.num_free_blocks == 5
    kv.cache_blocks("a", tokens, 10)
    assert kv.num_cached_blocks == 2  # the partial third block is never hashed
    assert kv.trim("a", 10) == 0
    kv.check_invariants()
    # The freed block is handed out before any cached one.
    assert kv.allocate("b", 1) and kv.block_table("b") == [table[3]]
    kv.free("a")
    kv.free("b")
    kv.check_invariants()
    assert kv.num_used_blocks == 0
    assert kv.lookup("c", tokens + [99]).num_tokens == 8


# ---- metrics ----


def test_spec_counters_use_vllm_names_and_appear_only_once_used() -> None:
    m = ServerMetrics("m")
    plain = RequestTimeline("p", arrival=0.0, finish_reason=FinishReason.STOP)
    m.observe_finished(plain)
    assert b"spec_decode" not in m.render()
    tl = RequestTimeline("s", arrival=0.0, finish_reason=FinishReason.ABORT)
    tl.spec = [SpecRecord(1, 3, 2), SpecRecord(2, 3, 0), SpecRecord(3, 2, 2)]
    m.observe_finished(tl)
    text = m.render().decode()
    labels = 'engine="0",model_name="m"'
    assert f"vllm:spec_decode_num_drafts_total{{{labels}}} 3.0" in text
    assert f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} 8.0" in text
    assert f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} 4.0" in text
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert f'{per_pos}{{{labels},position="0"}} 2.0' in text
    assert f'{per_pos}{{{labels},position="1"}} 2.0' in text
    assert f'{per_pos}{{{labels},position="2"}} 0.0' in text
