"""Test doubles for the engine's layer-below: a deterministic fake executor and tokenizer.

The fake executor stores each computed token in its own paged "KV cache" (a slot per
position, through the block tables it is given) and samples the next token as a hash of the
whole context *read back from that cache*. So a wrong block table, a skipped or repeated
token, or a stale prefix-cache block changes the output; ``reference_generate`` computes what
the output must be from the token list alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from servelab.engine.batch_plan import BatchPlan, StepOutput
from servelab.engine.sampling_params import SamplingParams

EOS = 0


def next_token(context: Sequence[int], vocab_size: int, banned: Sequence[int] = ()) -> int:
    """The fake model: a deterministic function of the whole context."""
    tok = (hash(tuple(context)) * 2654435761 >> 11) % vocab_size
    while tok in banned:
        tok = (tok + 1) % vocab_size
    return tok


def reference_generate(
    prompt: Sequence[int],
    sp: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    eos: Sequence[int] = (EOS,),
) -> list[int]:
    """What the engine must output for ``prompt`` alone (token rules only, no stop strings)."""
    ctx = list(prompt)
    out: list[int] = []
    while True:
        banned: list[int] = []
        if len(out) < sp.min_tokens:
            banned = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(eos))
        tok = next_token(ctx, vocab_size, banned)
        ctx.append(tok)
        out.append(tok)
        if len(out) >= sp.min_tokens and (
            tok in sp.stop_token_ids or (tok in eos and not sp.ignore_eos)
        ):
            return out
        if len(out) >= sp.max_tokens or len(ctx) >= max_model_len:
            return out


class FakeClock:
    """A virtual clock; the fake executor advances it inside ``execute``."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeExecutor:
    """Implements the Executor protocol without a model (see the module docstring)."""

    vocab_size: int = 1000
    max_model_len: int = 4096
    eos_token_ids: list[int] = field(default_factory=lambda: [EOS])
    clock: FakeClock | None = None
    step_overhead: float = 0.01  # virtual seconds per step ...
    per_token: float = 0.001  # ... plus per computed token
    fail_on_step: int | None = None  # raise inside execute at this step id
    plans: list[BatchPlan] = field(default_factory=list)

    def kv_block_bytes(self, block_size: int) -> int:
        return 64 * block_size

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.cache: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]

    def execute(self, plan: BatchPlan) -> StepOutput:
        if plan.step_id == self.fail_on_step:
            raise RuntimeError("injected executor failure")
        self.plans.append(plan)
        bs = self.block_size
        written: set[tuple[int, int]] = set()
        for seq in plan.seqs:  # write every seq's K/V first, like a layer of a real model
            assert seq.token_ids, "empty seq in plan"
            end = seq.start_pos + len(seq.token_ids)
            assert len(seq.block_table) * bs >= end, f"{seq.request_id}: block table too short"
            for i, tok in enumerate(seq.token_ids):
                p = seq.start_pos + i
                slot = (seq.block_table[p // bs], p % bs)
                assert slot not in written, f"two seqs wrote block slot {slot} in one step"
                written.add(slot)
                self.cache[slot[0]][slot[1]] = tok
        sampled: dict[str, list[int]] = {}
        for seq in plan.seqs:
            if not seq.sample:
                continue
            end = seq.start_pos + len(seq.token_ids)
            ctx = [self.cache[seq.block_table[p // bs]][p % bs] for p in range(end)]
            assert None not in ctx, f"{seq.request_id}: read a K/V slot never written"
            sampled[seq.request_id] = [next_token(ctx, self.vocab_size, seq.banned_token_ids)]
        elapsed = self.step_overhead + self.per_token * plan.num_tokens
        if self.clock is not None:
            self.clock.now += elapsed
        return StepOutput(sampled, elapsed)


class FakeTokenizer:
    """Each id decodes to a fixed piece; id 0 is a special token (EOS) that decodes to ''."""

    PIECES = ("<eos>", "a", "b", "c", " ", "ab", "St", "OP", "x", "yz", "\n")

    def __init__(self, vocab_size: int = 1000) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = [EOS]
        self.name = "fake"

    def piece(self, token_id: int) -> str:
        return self.PIECES[token_id % len(self.PIECES)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(
            self.piece(i) for i in ids if not (skip_special_tokens and i % len(self.PIECES) == 0)
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1 + ord(ch) % (self.vocab_size - 1) for ch in text]
