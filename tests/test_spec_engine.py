"""Speculative decoding end to end on the real torch runner (tiny random Llama; SmolLM2 once).

Greedy output must be token-identical with and without speculation, for every proposer,
under batching, chunked prefill, prefix caching, preemption and aborts; sampled output
must keep the target distribution; and after every step the KV bookkeeping must be exact:
each running request holds exactly the blocks its verified tokens need.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from servelab.engine.engine import LLMEngine
from servelab.engine.engine_config import EngineConfig
from servelab.engine.sampling_params import SamplingParams
from servelab.engine.spec.proposer import DraftRequest
from servelab.model.draft_model import DraftModelProposer, self_draft_model
from servelab.model.llama import causal_batch
from servelab.model.llm import LLM
from servelab.model.loader import LoadedModel, load_model
from servelab.model.quant import QuantWeight
from servelab.model.sampler import filtered_probs
from servelab.model.torch_runner import TorchModelRunner
from servelab.vocab import FinishReason, Phase

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
SELF_DRAFT = {
    "method": "self-draft",
    "num_speculative_tokens": 3,
    "num_layers": 1,
    "adaptive": False,
}

TEXTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps",
    "Prefill computes the prompt; decode produces one token per step.",
    "A paged KV cache stores keys and values in fixed-size blocks. " * 3,
    "Hello world!",
    "Continuous batching mixes prefill chunks with decode steps of other requests. " * 2,
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def make_engine(
    loaded: LoadedModel, spec: dict | None = None, proposer: Any = None, **cfg: Any
) -> LLMEngine:
    cfg.setdefault("block_size", 4)
    cfg.setdefault("num_kv_blocks", 512)
    runner = TorchModelRunner(loaded, device="cpu", num_threads=1, seed=0)
    config = EngineConfig(speculative_config=spec, **cfg)
    return LLMEngine(runner, config, tokenizer=loaded.tokenizer, proposer=proposer)


def check_kv(engine: LLMEngine) -> None:
    """Exact accounting: invariants hold and no request keeps a block of rejected drafts."""
    kv = engine.kv_cache
    kv.check_invariants()
    for req in engine.scheduler.running:
        assert len(kv.block_table(req.request_id)) == kv.blocks_needed(req.num_computed_tokens)
        assert not req.spec_token_ids or req.phase is Phase.DECODE
    for req in engine.scheduler.waiting:
        assert kv.block_table(req.request_id) == []


def step_once(engine: LLMEngine, out: dict[str, list[int]]) -> None:
    """One step: collect its tokens into ``out`` and check the KV bookkeeping after it."""
    for o in engine.step().outputs:
        out.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert o.finish_reason is not FinishReason.ERROR, o.timeline.error
    check_kv(engine)


def run(
    engine: LLMEngine, prompts: list[list[int]], sps: SamplingParams | list[SamplingParams]
) -> dict[str, list[int]]:
    """Generate ``r0``, ``r1``, ... to the end, checking the KV bookkeeping after every step."""
    sps = sps if isinstance(sps, list) else [sps] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        engine.add_request(f"r{i}", prompt_token_ids=p, sampling_params=sp)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        step_once(engine, out)
    assert engine.kv_cache.num_used_blocks == 0
    return out


def spec_totals(engine: LLMEngine) -> tuple[int, int]:
    proposed = sum(s.proposed for t in engine.finished_timelines for s in t.spec)
    accepted = sum(s.accepted for t in engine.finished_timelines for s in t.spec)
    steps = list(engine.step_records)
    assert (proposed, accepted) == (
        sum(r.spec_proposed for r in steps),
        sum(r.spec_accepted for r in steps),
    )
    return proposed, accepted


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), device="cpu")


@pytest.fixture(scope="module")
def prompts(tiny: LoadedModel) -> list[list[int]]:
    shared = tiny.tokenizer.encode("A paged KV cache stores keys and values in blocks. ")
    own = [tiny.tokenizer.encode(t) for t in TEXTS]
    return own + [shared + p for p in own[:2]]


@pytest.fixture(scope="module")
def reference(tiny: LoadedModel, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Non-speculative greedy output, each prompt alone."""
    return {f"r{i}": run(make_engine(tiny), [p], GREEDY)["r0"] for i, p in enumerate(prompts)}


def _spec(method: str, tiny_llama_dir: Path) -> dict:
    if method == "ngram":
        return NGRAM
    if method == "self-draft":
        return SELF_DRAFT
    # The target itself as its draft model: every greedy draft must be accepted.
    return {"method": "draft", "num_speculative_tokens": 3, "model": str(tiny_llama_dir)}


@pytest.mark.parametrize("method", ["ngram", "self-draft", "draft"])
@pytest.mark.parametrize(
    "cfg", [{}, {"max_num_batched_tokens": 8}], ids=["prefix-cache", "chunked-8"]
)
@pytest.mark.parametrize("batch", ["alone", "batched"])
def test_greedy_output_is_identical(
    tiny: LoadedModel,
    tiny_llama_dir: Path,
    prompts: list[list[int]],
    reference: dict[str, list[int]],
    method: str,
    cfg: dict,
    batch: str,
) -> None:
    engine = make_engine(tiny, _spec(method, tiny_llama_dir), **cfg)
    if batch == "alone":
        got = {f"r{i}": run(engine, [p], GREEDY)["r0"] for i, p in enumerate(prompts[:2])}
        want = {k: reference[k] for k in got}
    else:
        # One shared-prefix prompt first, so that the batch finds its blocks in the cache.
        assert run(engine, prompts[-1:], GREEDY)["r0"] == reference[f"r{len(prompts) - 1}"]
        got, want = run(engine, prompts, GREEDY), reference
        assert engine.stats().prefix_cache_hits > 0
    assert got == want
    proposed, accepted = spec_totals(engine)
    assert proposed > 0 and accepted > 0
    if method == "draft":
        assert accepted == proposed
    if method == "draft" and batch == "alone":
        # Several tokens per step: fewer decode steps than tokens.
        decode_steps = sum(1 for r in engine.step_records if r.decode_seqs)
        assert decode_steps < sum(len(t) for t in want.values()) / 2


def test_blocks_written_under_speculation_are_cached_correctly(
    tiny: LoadedModel, prompts: list[list[int]]
) -> None:
    """A follow-up turn reuses the blocks of a speculated answer from the prefix cache;
    wrong hashes or K/V there would change its output."""
    first = make_engine(tiny)
    answer = run(first, prompts[:1], GREEDY)["r0"]
    follow = prompts[0] + answer + prompts[3]
    want = run(make_engine(tiny), [follow], GREEDY)["r0"]
    engine = make_engine(tiny, NGRAM)
    assert run(engine, prompts[:1], GREEDY)["r0"] == answer
    assert run(engine, [follow], GREEDY)["r0"] == want
    cached = engine.finished_timelines[-1].cached_tokens
    assert cached > len(prompts[0]) + 4  # blocks holding speculated output were hits


def test_preemption_in_the_middle_of_speculation(
    tiny: LoadedModel, prompts: list[list[int]], reference: dict[str, list[int]]
) -> None:
    engine = make_engine(tiny, NGRAM, num_kv_blocks=30, max_num_batched_tokens=64)
    assert run(engine, prompts, GREEDY) == reference
    assert engine.stats().num_preemptions > 0
    assert spec_totals(engine)[1] > 0


def test_priority_preemption_unschedules_a_speculating_request(
    tiny: LoadedModel, prompts: list[list[int]], reference: dict[str, list[int]]
) -> None:
    """Low-priority requests speculate; high-priority arrivals preempt them, some after they
    were already scheduled with drafts in that step (their tokens and budget come back)."""
    engine = make_engine(tiny, NGRAM, num_kv_blocks=32, max_num_batched_tokens=64)
    out: dict[str, list[int]] = {}
    for i in range(3):
        engine.add_request(f"r{i}", prompt_token_ids=prompts[i], sampling_params=GREEDY, priority=1)
    while not all(engine.get_timeline(f"r{i}").spec for i in range(3)):
        step_once(engine, out)
    for i in (3, 4):
        engine.add_request(f"r{i}", prompt_token_ids=prompts[i], sampling_params=GREEDY)
    while engine.has_unfinished():
        step_once(engine, out)
    assert out == {f"r{i}": reference[f"r{i}"] for i in range(5)}
    assert any(
        t.spec[0].step_id < _step_at(engine, when)
        for t in engine.finished_timelines
        for when in t.preemptions
    ), "no request was preempted after it had speculated"


def _step_at(engine: LLMEngine, when: float) -> int:
    return max(r.step_id for r in engine.step_records if r.start <= when)


def test_abort_while_speculating_frees_everything(
    tiny: LoadedModel, tiny_llama_dir: Path, prompts: list[list[int]]
) -> None:
    spec = {"method": "draft", "num_speculative_tokens": 3, "model": str(tiny_llama_dir)}
    engine = make_engine(tiny, spec)
    for i, p in enumerate(prompts[:3]):
        engine.add_request(f"r{i}", prompt_token_ids=p, sampling_params=GREEDY)
    while not engine.get_timeline("r1").spec:
        engine.step()
        check_kv(engine)
    assert engine.abort("r1")
    check_kv(engine)
    proposer = engine.spec.proposer
    assert isinstance(proposer, DraftModelProposer)
    assert proposer.kv.block_table("r1") == []
    while engine.has_unfinished():
        engine.step()
        check_kv(engine)
    assert engine.kv_cache.num_used_blocks == 0
    assert proposer.kv.num_used_blocks == 0  # the draft pool is released as requests end
    assert engine.get_timeline("r1").finish_reason is FinishReason.ABORT


def test_stop_rules_inside_accepted_drafts(tiny: LoadedModel, prompts: list[list[int]]) -> None:
    base = run(make_engine(tiny), prompts[:1], GREEDY)["r0"]
    stop_id = base[len(base) // 2]
    eos = tiny.tokenizer.eos_token_ids
    sps = [
        SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_id]),
        SamplingParams(max_tokens=24, temperature=0.0, min_tokens=6, stop_token_ids=[base[2]]),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=eos),
    ]
    want = run(make_engine(tiny), [prompts[0]] * len(sps), sps)
    engine = make_engine(tiny, NGRAM)
    assert run(engine, [prompts[0]] * len(sps), sps) == want
    assert want["r0"][-1] == stop_id and len(want["r2"]) == 7


def test_speculative_and_plain_requests_share_a_batch(
    tiny: LoadedModel, prompts: list[list[int]], reference: dict[str, list[int]]
) -> None:
    # Requests under min_tokens with EOS banned may not speculate past the ban; sampled ones
    # speculate too. Greedy ones must match the reference whatever they are batched with.
    sps = [
        GREEDY,
        SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, min_tokens=20),
        GREEDY,
    ]
    engine = make_engine(tiny, NGRAM)
    got = run(engine, prompts[:4], sps)
    assert got["r0"] == reference["r0"] and got["r3"] == reference["r3"]
    proposing: dict[int, set[str]] = {}  # step id -> requests that verified drafts in it
    for t in engine.finished_timelines:
        for s in t.spec:
            proposing.setdefault(s.step_id, set()).add(t.request_id)
    mixed = [
        r
        for r in engine.step_records
        if set(r.decode) - proposing.get(r.step_id, set()) and r.step_id in proposing
    ]
    assert mixed, "no step mixed speculative and plain decodes"


def test_rejection_sampling_preserves_the_target_distribution(tiny: LoadedModel) -> None:
    """The joint law of the first three sampled tokens, from 3000 requests whose drafts are
    often wrong, against the exact law computed from the model: chi-square p > 0.001 (the
    seeds are fixed, so the outcome is deterministic). Temperature 2 and top-k 4 keep every
    cell populated; the drafts are the target's first or second choice, so drafts are
    accepted, rejected (residual sampling) and followed by bonus tokens."""
    from scipy.stats import chisquare

    top_k, n_requests = 4, 3000
    prompt = tiny.tokenizer.encode("A paged KV cache")
    sp_args = {"max_tokens": 4, "temperature": 2.0, "top_k": top_k, "ignore_eos": True}
    params = SamplingParams(**sp_args)

    # Exact conditionals for every context the first three tokens can see.
    contexts: list[tuple[int, ...]] = [tuple(prompt)]
    probs: dict[tuple[int, ...], torch.Tensor] = {}
    for _depth in range(3):
        todo = [c for c in contexts if c not in probs]
        logits = tiny.model(causal_batch([list(c) for c in todo]))
        ends = torch.tensor([len(c) for c in todo]).cumsum(0) - 1
        for c, row in zip(todo, filtered_probs(logits[ends], params)):
            probs[c] = row
        contexts = [c + (t,) for c in todo for t in probs[c].nonzero().flatten().tolist()]
    exact: dict[tuple[int, ...], float] = {}
    for c in contexts:  # prompt + 3 tokens
        p = 1.0
        for i in range(3):
            p *= float(probs[c[: len(prompt) + i]][c[len(prompt) + i]])
        exact[c[len(prompt) :]] = p

    class HashProposer:
        """Drafts the target's first or second choice, picked by a hash of the context."""

        def propose(self, batch: list[DraftRequest]) -> dict[str, list[int]]:
            out = {}
            for r in batch:
                ctx, drafts = tuple(r.token_ids), []
                for _ in range(r.max_tokens):
                    ranked = probs[ctx].argsort(descending=True)[:2].tolist()
                    drafts.append(ranked[(sum(ctx) * 31 + len(ctx)) % 2])
                    ctx += (drafts[-1],)
                out[r.request_id] = drafts
            return out

        def remove(self, request_id: str) -> None:
            pass

    engine = make_engine(
        tiny,
        {"method": "ngram", "num_speculative_tokens": 2, "adaptive": False},
        proposer=HashProposer(),
        num_kv_blocks=4096,
        max_num_seqs=512,
        max_num_batched_tokens=8192,
    )
    sps = [SamplingParams(**sp_args, seed=i if i % 2 else None) for i in range(n_requests)]
    results = LLM.from_engine(engine).generate([prompt] * n_requests, sps)
    counts: dict[tuple[int, ...], int] = {}
    for r in results:
        key = tuple(r.token_ids[:3])
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(exact), "sampled a token outside the top-k support"
    proposed, accepted = spec_totals(engine)
    assert 0.2 < accepted / proposed < 0.8, "both acceptance and rejection must be exercised"

    # Cells expected to hold fewer than 5 samples are pooled into one.
    cells = sorted(exact, key=exact.get, reverse=True)
    big = [c for c in cells if exact[c] * n_requests >= 5]
    small = [c for c in cells if c not in big]
    observed = [counts.get(c, 0) for c in big] + [sum(counts.get(c, 0) for c in small)]
    expected = [exact[c] * n_requests for c in big] + [sum(exact[c] for c in small) * n_requests]
    scale = sum(observed) / sum(expected)  # exact sums to 1 up to float rounding
    result = chisquare(observed, [e * scale for e in expected])
    assert result.pvalue > 1e-3, (result, list(zip(observed, expected)))


def _storage(w: torch.Tensor | QuantWeight) -> int:
    return (w.blocks if isinstance(w, QuantWeight) else w).data_ptr()


def test_self_draft_shares_the_targets_weights(tiny: LoadedModel) -> None:
    view = self_draft_model(tiny, 1)
    assert len(view.model.layers) == 1 and view.config.num_layers == 1
    assert len(tiny.model.layers) == tiny.config.num_layers == 2  # the target is untouched
    assert view.model.layers[0] is tiny.model.layers[0]
    assert _storage(view.model.embed) == _storage(tiny.model.embed)
    assert _storage(view.model.lm_head) == _storage(tiny.model.lm_head)
    with pytest.raises(ValueError, match="between 1 and the target's 2 layers"):
        self_draft_model(tiny, 3)


def test_bad_speculative_setups_fail_clearly(
    tiny: LoadedModel, make_tiny_llama: Any, tiny_llama_dir: Path
) -> None:
    other_vocab = make_tiny_llama(vocab_size=512)
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        make_engine(
            tiny, {"method": "draft", "num_speculative_tokens": 2, "model": str(other_vocab)}
        )
    with pytest.raises(ValueError, match="needs speculative_config"):
        make_engine(tiny, proposer=object())
    from engine_fakes import FakeExecutor

    with pytest.raises(ValueError, match="needs the torch model runner"):
        LLMEngine(FakeExecutor(), EngineConfig(num_kv_blocks=16, speculative_config=SELF_DRAFT))


@pytest.mark.slow
def test_smollm2_copy_prompt_identical_and_faster_in_steps(smollm2_path: Path) -> None:
    smol = load_model(str(smollm2_path), device="cpu")
    tok = smol.tokenizer
    text = (
        "The river rises in the hills, runs past the old mill and the church, "
        "and reaches the sea at the harbour town."
    )
    msg = f"Repeat this sentence exactly, word for word:\n{text}"
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": msg}]))
    sp = SamplingParams(max_tokens=32, temperature=0.0)
    plain = make_engine(smol, num_kv_blocks=64, block_size=16)
    want = run(plain, [prompt], sp)["r0"]
    spec = make_engine(
        smol, {"method": "ngram", "num_speculative_tokens": 4}, num_kv_blocks=64, block_size=16
    )
    assert run(spec, [prompt], sp)["r0"] == want
    assert spec_totals(spec)[1] > 0
    assert len(spec.step_records) < len(plain.step_records)
