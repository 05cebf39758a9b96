"""The torch executor driven by hand-built batch plans (no scheduler involved)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from servelab.engine.batch_plan import BatchPlan, ScheduledSeq
from servelab.engine.sampling_params import SamplingParams
from servelab.model.llama import causal_batch
from servelab.model.loader import LoadedModel, load_model
from servelab.model.torch_runner import TorchModelRunner

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), device="cpu")


def make_runner(
    loaded: LoadedModel, num_blocks: int = 256, seed: int | None = 0
) -> TorchModelRunner:
    runner = TorchModelRunner(loaded, device="cpu", num_threads=1, seed=seed)
    runner.allocate_kv(num_blocks, BLOCK)
    return runner


@dataclass
class Seq:
    """A hand-driven request: its blocks are a fixed range, tokens grow as it decodes."""

    rid: str
    tokens: list[int]
    first_block: int
    params: SamplingParams = field(default_factory=lambda: GREEDY)
    computed: int = 0
    out: list[int] = field(default_factory=list)

    @property
    def table(self) -> list[int]:
        return list(range(self.first_block, self.first_block + 32))

    def chunk(self, n: int | None = None, sample: bool = True) -> ScheduledSeq:
        todo = self.tokens[self.computed :]
        ids = todo if n is None else todo[:n]
        return ScheduledSeq(
            request_id=self.rid,
            token_ids=ids,
            start_pos=self.computed,
            block_table=self.table,
            sample=sample,
            sampling=self.params,
            num_output_tokens=len(self.out),
        )

    def advance(self, sched: ScheduledSeq, sampled: dict[str, list[int]]) -> None:
        self.computed += len(sched.token_ids)
        for t in sampled.get(self.rid, []):
            self.out.append(t)
            self.tokens.append(t)


def step(runner: TorchModelRunner, pairs: list[tuple[Seq, ScheduledSeq]], step_id: int = 0) -> None:
    out = runner.execute(BatchPlan(step_id, [s for _, s in pairs]))
    assert out.elapsed > 0
    for seq, sched in pairs:
        seq.advance(sched, out.sampled)


def generate_alone(runner: TorchModelRunner, seq: Seq, n: int) -> list[int]:
    while len(seq.out) < n:
        step(runner, [(seq, seq.chunk())])
    return seq.out


def prompt(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.tokenizer.encode(text)


def test_greedy_decode_matches_full_recompute(tiny: LoadedModel) -> None:
    ids = prompt(tiny, "The quick brown fox jumps over")
    got = generate_alone(make_runner(tiny), Seq("a", list(ids), 0), 10)
    expect: list[int] = []
    for _ in range(10):
        expect.append(int(tiny.model(causal_batch([ids + expect]))[-1].argmax()))
    assert got == expect


def test_greedy_matches_transformers_generate(tiny: LoadedModel, tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    ids = prompt(tiny, "Hello world! How are you")
    with torch.no_grad():
        hf = ref.generate(
            torch.tensor([ids]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
    assert generate_alone(make_runner(tiny), Seq("a", list(ids), 0), 12) == hf


def test_mixed_batch_equals_each_sequence_alone(tiny: LoadedModel) -> None:
    """One sequence prefills in two chunks while two others decode, in the same steps."""
    texts = [
        "A paged KV cache stores keys and values in fixed-size blocks. " * 3,
        "Hello world!",
        "Numbers like 12345",
    ]
    alone = [
        generate_alone(make_runner(tiny), Seq(str(i), prompt(tiny, t), 0), 6)
        for i, t in enumerate(texts)
    ]

    runner = make_runner(tiny)
    long, d1, d2 = (Seq(str(i), prompt(tiny, t), 60 * i) for i, t in enumerate(texts))
    step(runner, [(d1, d1.chunk()), (d2, d2.chunk())])  # the two short ones prefill
    half = len(long.tokens) // 2
    assert half > 16  # both chunks take the long-prefill attention paths
    step(runner, [(long, long.chunk(half, sample=False)), (d1, d1.chunk()), (d2, d2.chunk())])
    step(runner, [(d1, d1.chunk()), (long, long.chunk()), (d2, d2.chunk())])  # order shuffled
    while min(len(s.out) for s in (long, d1, d2)) < 6:
        step(runner, [(s, s.chunk()) for s in (long, d1, d2) if len(s.out) < 6])
    assert [long.out[:6], d1.out[:6], d2.out[:6]] == alone


def test_mixed_batch_logits_close_to_alone(tiny: LoadedModel) -> None:
    a = prompt(tiny, "Continuous batching mixes prefill chunks with decode steps")
    b = prompt(tiny, "The quick brown fox jumps over the lazy dog")
    runner = make_runner(tiny)
    sa, sb = Seq("a", list(a), 0), Seq("b", list(b[:-1]), 50)
    step(runner, [(sb, sb.chunk(sample=False))])  # b's context minus its last token
    sb.tokens.append(b[-1])
    plan = BatchPlan(1, [sa.chunk(20, sample=True), sb.chunk()])  # a: first chunk; b: decode
    logits, seqs = runner.logits(plan)
    assert [s.request_id for s in seqs] == ["a", "b"]
    ref_a = tiny.model(causal_batch([a[:20]]))[-1]
    ref_b = tiny.model(causal_batch([b]))[-1]
    torch.testing.assert_close(logits[0], ref_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], ref_b, atol=1e-4, rtol=1e-4)


def test_seeded_sampling_does_not_depend_on_batching(tiny: LoadedModel) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=64)
    ids = prompt(tiny, "Hello world!")
    alone = generate_alone(make_runner(tiny, seed=1), Seq("a", list(ids), 0, params), 8)
    runner = make_runner(tiny, seed=2)
    a = Seq("a", list(ids), 0, params)
    other = Seq("o", prompt(tiny, "The quick brown fox"), 40, SamplingParams(temperature=1.0))
    while len(a.out) < 8:
        step(runner, [(other, other.chunk()), (a, a.chunk())])
    assert a.out == alone
    different_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=64)
    assert generate_alone(make_runner(tiny), Seq("c", list(ids), 0, different_seed), 8) != alone


def test_filters_and_banned_tokens(tiny: LoadedModel) -> None:
    ids = prompt(tiny, "Hello world!")
    greedy = generate_alone(make_runner(tiny), Seq("g", list(ids), 0), 6)
    top1 = SamplingParams(temperature=1.5, top_k=1, max_tokens=64)
    assert generate_alone(make_runner(tiny), Seq("k", list(ids), 0, top1), 6) == greedy
    tiny_p = SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=64)
    assert generate_alone(make_runner(tiny), Seq("p", list(ids), 0, tiny_p), 6) == greedy
    runner = make_runner(tiny)
    seq = Seq("b", list(ids), 0)
    banned = ScheduledSeq("b", list(ids), 0, seq.table, True, GREEDY, banned_token_ids=[greedy[0]])
    out = runner.execute(BatchPlan(0, [banned])).sampled["b"]
    assert out != [greedy[0]] and len(out) == 1


def test_draft_tokens_are_verified(tiny: LoadedModel) -> None:
    ids = prompt(tiny, "The quick brown fox")
    greedy = generate_alone(make_runner(tiny), Seq("g", list(ids), 0), 5)
    runner = make_runner(tiny)
    seq = Seq("s", list(ids), 0)
    step(runner, [(seq, seq.chunk(len(ids) - 1, sample=False))])
    good = seq.chunk()
    good.draft_token_ids = greedy[:3]
    assert runner.execute(BatchPlan(1, [good])).sampled["s"] == greedy[:4]  # 3 accepted + bonus
    runner = make_runner(tiny)
    seq = Seq("s", list(ids), 0)
    step(runner, [(seq, seq.chunk(len(ids) - 1, sample=False))])
    bad = seq.chunk()
    bad.draft_token_ids = [greedy[0], (greedy[1] + 1) % tiny.config.vocab_size, greedy[2]]
    assert runner.execute(BatchPlan(1, [bad])).sampled["s"] == greedy[:2]  # 1 accepted + fix


def test_kv_blocks_transfer_between_runners(tiny: LoadedModel) -> None:
    """Prefill on one runner, move the blocks, decode on another (disaggregation)."""
    ids = prompt(tiny, "A paged KV cache stores keys and values")
    expect = generate_alone(make_runner(tiny), Seq("x", list(ids), 0), 5)
    prefill, decode = make_runner(tiny), make_runner(tiny)
    seq = Seq("x", list(ids), 8)
    step(prefill, [(seq, seq.chunk())])
    used = seq.table[: -(-len(ids) // BLOCK)]
    decode.write_blocks(used, prefill.read_blocks(used))
    while len(seq.out) < 5:
        step(decode, [(seq, seq.chunk())])
    assert seq.out == expect
    # copy_blocks moves a sequence to other blocks in place.
    moved = list(range(100, 100 + len(used)))
    decode.copy_blocks(used, moved)
    assert all(
        torch.equal(a, b) for a, b in zip(decode.read_blocks(used), decode.read_blocks(moved))
    )


def test_bad_plans_are_rejected(tiny: LoadedModel) -> None:
    runner = make_runner(tiny, num_blocks=8)
    ids = list(range(3, 20))
    with pytest.raises(ValueError, match="block table"):
        runner.execute(BatchPlan(0, [ScheduledSeq("a", ids, 0, [0], True, GREEDY)]))
    with pytest.raises(ValueError, match="outside"):
        runner.execute(BatchPlan(0, [ScheduledSeq("a", ids, 0, [0, 1, 2, 3, 99], True, GREEDY)]))
    with pytest.raises(ValueError, match="context"):
        runner.execute(
            BatchPlan(0, [ScheduledSeq("a", [5], runner.max_model_len, [0] * 600, True, GREEDY)])
        )
    with pytest.raises(RuntimeError, match="allocate_kv"):
        TorchModelRunner(tiny, device="cpu", num_threads=1).execute(BatchPlan(0, []))


def test_executor_protocol_figures(tiny: LoadedModel) -> None:
    runner = make_runner(tiny)
    cfg = tiny.config
    assert (
        runner.kv_block_bytes(16) == 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    )
    assert runner.max_model_len == 2048
    assert runner.eos_token_ids == [2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_runner_matches_cpu(tiny_llama_dir: Path) -> None:
    ids = prompt(load_model(str(tiny_llama_dir), device="cpu"), "The quick brown fox jumps over")
    outs = []
    for device in ("cpu", "cuda"):
        loaded = load_model(str(tiny_llama_dir), device=device)
        runner = TorchModelRunner(loaded, device=device, seed=0)
        runner.allocate_kv(64, BLOCK)
        outs.append(generate_alone(runner, Seq("a", list(ids), 0), 10))
    assert outs[0] == outs[1]


def decode_draft_chunk_logits(runner: TorchModelRunner, loaded: LoadedModel) -> torch.Tensor:
    """Prefill three prompts but their last 3 tokens, then return the logits of one step
    of short sequences only: a decode, a decode with 2 drafts and a 3-token chunk."""
    texts = ["Hello world! How are you", "Numbers like 12345 and 678", "A paged KV cache"]
    seqs = [Seq(str(i), prompt(loaded, t), 40 * i) for i, t in enumerate(texts)]
    for s in seqs:
        step(runner, [(s, s.chunk(len(s.tokens) - 3, sample=False))])
    plan = BatchPlan(
        1,
        [
            seqs[0].chunk(1),
            dataclasses.replace(seqs[1].chunk(1), draft_token_ids=seqs[1].tokens[-2:]),
            seqs[2].chunk(3),
        ],
    )
    return runner.logits(plan)[0]


def test_decode_attention_kernel_matches_gathered_sdpa(tiny: LoadedModel) -> None:
    """The CPU kernel (K/V read in place) and the fallback (blocks gathered for SDPA) give
    the same logits for a batch of decodes, a draft run and a short chunk."""
    from servelab.model import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("CPU kernels not built here")
    logits = []
    for kernel in (True, False):
        runner = make_runner(tiny)
        runner.paged_kernel = kernel
        logits.append(decode_draft_chunk_logits(runner, tiny))
    assert logits[0].shape[0] == 1 + 3 + 1
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_decoder_stack_matches_layer_by_layer(model_type: str, make_tiny_llama) -> None:
    """All layers in one kernel call (decode steps) against one layer at a time: the same
    logits and the same K/V written to the cache, with qkv bias (Qwen2) and without, for
    decodes, a draft run and a short chunk at 1 and 2 threads."""
    from servelab.model import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("CPU kernels not built here")
    loaded = load_model(str(make_tiny_llama(model_type=model_type)), device="cpu")
    for threads in (1, 2):
        logits, caches = [], []
        for fused in (True, False):
            runner = make_runner(loaded)
            cpu_kernels.set_num_threads(threads)
            runner.model.fuse_decode = fused
            runner.model._stack = None
            logits.append(decode_draft_chunk_logits(runner, loaded))
            assert (runner.model._stack is not None) == fused  # the path under test ran
            caches.append(runner.kv.clone())
        torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(caches[0], caches[1], atol=1e-5, rtol=1e-5)
        assert caches[0].abs().sum() > 0
    cpu_kernels.set_num_threads(1)


def test_draw_follows_the_weights() -> None:
    """Inverse-transform sampling: frequencies match the weights (chi-square), a zero
    weight is never drawn, and a seeded generator repeats its draws."""
    from scipy.stats import chisquare

    from servelab.model.sampler import draw

    weights = torch.tensor([0.0, 1.0, 2.0, 0.0, 4.0, 1.0])
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros(6)
    for _ in range(4000):
        counts[draw(weights, gen)] += 1
    assert counts[0] == counts[3] == 0
    expected = weights[[1, 2, 4, 5]] / weights.sum() * 4000
    assert chisquare(counts[[1, 2, 4, 5]].numpy(), expected.numpy()).pvalue > 1e-3
    a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert [draw(weights, a) for _ in range(20)] == [draw(weights, b) for _ in range(20)]
