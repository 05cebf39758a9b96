"""The engine on the real torch runner: the tiny random Llama, and SmolLM2-135M.

Every scheduling choice (batching, chunk size, prefix-cache reuse, preemption) must leave
the greedy tokens unchanged; the tiny model is also checked against transformers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from model_helpers import PROMPT_TEXTS, TINY_SP, alone, generate, make_engine

from servelab.engine.sampling_params import SamplingParams
from servelab.model.build import build_engine
from servelab.model.llm import LLM
from servelab.model.loader import LoadedModel, load_model
from servelab.vocab import FinishReason

# ---- tiny random Llama ----


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), device="cpu")


@pytest.fixture(scope="module")
def tiny_prompts(tiny: LoadedModel) -> list[list[int]]:
    shared = tiny.tokenizer.encode("A paged KV cache stores keys and values in blocks. ")
    own = [tiny.tokenizer.encode(t) for t in PROMPT_TEXTS]
    return own + [shared + p for p in own[:3]]


@pytest.fixture(scope="module")
def tiny_alone(tiny: LoadedModel, tiny_prompts: list[list[int]]) -> list[list[int]]:
    return alone(tiny, tiny_prompts, TINY_SP)


@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"max_num_batched_tokens": 8},
        {"max_num_batched_tokens": 16, "enable_chunked_prefill": False},
        {"num_kv_blocks": 30, "max_num_batched_tokens": 64},
    ],
    ids=["batched", "chunked-8", "unchunked", "tiny-pool"],
)
def test_tiny_batched_equals_alone(
    tiny: LoadedModel, tiny_prompts: list[list[int]], tiny_alone: list[list[int]], cfg: dict
) -> None:
    engine = make_engine(tiny, **cfg)
    assert generate(engine, tiny_prompts, TINY_SP) == tiny_alone
    assert engine.stats().kv_blocks_used == 0
    engine.kv_cache.check_invariants()
    if cfg.get("num_kv_blocks") == 30:
        assert engine.stats().num_preemptions > 0
    if cfg.get("max_num_batched_tokens") == 8:
        assert any(len(t.chunks) > 1 for t in engine.finished_timelines)


def test_tiny_prefix_cache_hit_equals_no_cache(
    tiny: LoadedModel, tiny_prompts: list[list[int]], tiny_alone: list[list[int]]
) -> None:
    engine = make_engine(tiny)
    generate(engine, tiny_prompts[:1], TINY_SP)  # warm the cache with one prompt
    got = generate(engine, tiny_prompts, TINY_SP)  # again, with the shared-prefix ones
    assert got == tiny_alone
    hits = {t.request_id: t.cached_tokens for t in engine.finished_timelines}
    assert engine.stats().prefix_cache_hits > 0 and max(hits.values()) > 0
    off = make_engine(tiny, enable_prefix_caching=False)
    assert generate(off, tiny_prompts, TINY_SP) == tiny_alone
    assert off.stats().prefix_cache_hits == 0


def test_tiny_matches_transformers(
    tiny_llama_dir: Path, tiny_prompts: list[list[int]], tiny_alone: list[list[int]]
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    for prompt, ours in zip(tiny_prompts, tiny_alone):
        x = torch.tensor([prompt])
        with torch.inference_mode():
            out = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=10,
                min_new_tokens=10,
                do_sample=False,
                pad_token_id=0,
            )
        assert out[0, len(prompt) :].tolist() == ours


def test_tiny_seeded_sampling_is_batch_invariant(
    tiny: LoadedModel, tiny_prompts: list[list[int]]
) -> None:
    sps = [SamplingParams(max_tokens=8, temperature=0.9, seed=10 + i) for i in range(3)]
    batched = LLM.from_engine(make_engine(tiny, max_num_batched_tokens=8)).generate(
        tiny_prompts[:3], sps
    )
    for p, sp, r in zip(tiny_prompts, sps, batched):
        assert LLM.from_engine(make_engine(tiny)).generate([p], sp)[0].token_ids == r.token_ids


def test_tiny_text_stop_strings_and_timeline(tiny: LoadedModel) -> None:
    llm = LLM.from_engine(make_engine(tiny))
    free = llm.generate(["Hello world!"], SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert free.text == tiny.tokenizer.decode(free.token_ids)
    text = free.text
    cut = next((i for i in range(3, len(text) - 2) if text[i : i + 2].strip()), None)
    if cut is None:
        pytest.skip("the random model produced no usable text")
    stop = text[cut : cut + 2]
    res = llm.generate(
        ["Hello world!"], SamplingParams(max_tokens=24, temperature=0.0, stop=[stop])
    )
    assert res[0].text == text[: text.find(stop)]
    assert res[0].finish_reason is FinishReason.STOP
    tl = res[0].timeline
    assert tl.first_token is not None and tl.finished >= tl.first_token >= tl.scheduled[0]
    assert len(tl.token_times) == len(res[0].token_ids) == tl.output_tokens


def test_tiny_bad_parameters_raise_clear_errors(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    limit = engine.config.max_model_len
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=-3)
    with pytest.raises(ValueError, match=f"context is {limit} tokens"):
        engine.add_request("long", prompt_token_ids=[5] * (limit + 1))
    with pytest.raises(ValueError, match="lower max_tokens"):
        engine.add_request("x", prompt="Hello", sampling_params=SamplingParams(max_tokens=limit))
    with pytest.raises(ValueError, match="smollm2-135m"):
        build_engine("no-such-model")


# ---- SmolLM2-135M (real weights, real tokenizer) ----


@pytest.fixture(scope="module")
def smol(smollm2_path: Path) -> LoadedModel:
    return load_model(str(smollm2_path), device="cpu")


@pytest.fixture(scope="module")
def smol_prompts(smol: LoadedModel) -> list[list[int]]:
    tok = smol.tokenizer
    system = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
    questions = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?"]
    return [
        tok.encode(tok.apply_chat_template([system, {"role": "user", "content": q}]))
        for q in questions
    ]


SMOL_SP = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def smol_alone(smol: LoadedModel, smol_prompts: list[list[int]]) -> list[list[int]]:
    return alone(smol, smol_prompts, SMOL_SP)


@pytest.mark.slow
def test_smollm2_answers_sensibly(smol: LoadedModel, smol_prompts: list[list[int]]) -> None:
    res = LLM.from_engine(make_engine(smol)).generate(
        smol_prompts[:1], SamplingParams(max_tokens=12, temperature=0.0)
    )
    assert "Paris" in res[0].text


@pytest.mark.slow
@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"max_num_batched_tokens": 16},
        {"num_kv_blocks": 24, "block_size": 4},
    ],
    ids=["batched", "chunked-16", "tiny-pool"],
)
def test_smollm2_batched_equals_alone(
    smol: LoadedModel, smol_prompts: list[list[int]], smol_alone: list[list[int]], cfg: dict
) -> None:
    engine = make_engine(smol, **cfg)
    assert generate(engine, smol_prompts, SMOL_SP) == smol_alone
    if "num_kv_blocks" in cfg:
        assert engine.stats().num_preemptions > 0
    assert engine.stats().kv_blocks_used == 0


@pytest.mark.slow
def test_smollm2_prefix_cache_hit_equals_no_cache(
    smol: LoadedModel, smol_prompts: list[list[int]], smol_alone: list[list[int]]
) -> None:
    engine = make_engine(smol)
    generate(engine, smol_prompts[:1], SMOL_SP)  # caches the shared system prompt
    assert generate(engine, smol_prompts[1:], SMOL_SP) == smol_alone[1:]
    cached = [t.cached_tokens for t in list(engine.finished_timelines)[1:]]
    assert all(c >= 16 for c in cached)  # the system prompt's full blocks
