"""Token selection from logits: greedy, temperature, top-k, top-p, banned ids, seeds, drafts.

Contract (see ``ScheduledSeq``):
- ``banned_token_ids`` get zero probability at every row of the sequence.
- With ``sampling.seed`` the output token at index ``n`` (counting the request's output
  tokens) is drawn from a generator seeded by ``(seed, n)`` only, so a seeded request
  produces the same tokens whatever it is batched with.
- With draft tokens the rows are the logits after the last input token and after each
  draft. A draft is accepted if it is what the target would pick (greedy), or with the
  target's probability of it (sampling; the draft is a point mass, so this is exact
  speculative sampling); the first rejection is replaced by a token from the residual
  distribution, and when all drafts pass a bonus token follows. The result is always
  ``accepted drafts + 1`` tokens.
"""

from __future__ import annotations

import torch

from servelab.engine.batch_plan import ScheduledSeq
from servelab.engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def derive_seed(seed: int, output_index: int) -> int:
    """A well-mixed 63-bit seed from (request seed, output token index) (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + output_index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [rows, V] after temperature, top-k and top-p (nucleus) filtering."""
    x = logits / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        # Drop a token once the mass strictly before it already reaches top_p; the most
        # likely token always survives.
        drop = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= params.top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, sorted_x)
    return torch.softmax(x, dim=-1)


def draw(weights: torch.Tensor, gen: torch.Generator) -> int:
    """One index of ``weights`` (>= 0, any positive sum) with probability proportional to its
    weight, by inverse transform: one uniform draw. ``torch.multinomial`` draws one
    exponential per vocabulary entry, ~1.2 ms for 49k entries on this CPU, per sampled
    sequence per step. An index of weight 0 is never drawn."""
    cdf = torch.cumsum(weights, 0)
    u = torch.rand((), generator=gen, device=weights.device) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp_(max=weights.numel() - 1))


class Sampler:
    """Picks tokens for the sampled sequences of a step. ``seed`` seeds unseeded requests."""

    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.device = device
        self._default = torch.Generator(device=device)
        if seed is None:
            self._default.seed()
        else:
            self._default.manual_seed(seed)

    def _generator(self, params: SamplingParams, output_index: int) -> torch.Generator:
        if params.seed is None:
            return self._default
        return torch.Generator(device=self.device).manual_seed(
            derive_seed(params.seed, output_index)
        )

    def sample(self, logits: torch.Tensor, seqs: list[ScheduledSeq]) -> dict[str, list[int]]:
        """``logits`` holds ``1 + len(draft_token_ids)`` consecutive rows per sequence."""
        if all(
            s.sampling.greedy and not s.draft_token_ids and not s.banned_token_ids for s in seqs
        ):
            return {s.request_id: [t] for s, t in zip(seqs, logits.argmax(-1).tolist())}
        out: dict[str, list[int]] = {}
        row = 0
        for s in seqs:
            n_rows = 1 + len(s.draft_token_ids)
            rows = logits[row : row + n_rows]
            row += n_rows
            if s.banned_token_ids:
                rows = rows.clone()
                rows[:, s.banned_token_ids] = float("-inf")
            out[s.request_id] = self._sample_seq(rows, s)
        return out

    def _sample_seq(self, rows: torch.Tensor, s: ScheduledSeq) -> list[int]:
        drafts = s.draft_token_ids
        if s.sampling.greedy:
            targets = rows.argmax(-1).tolist()
            tokens: list[int] = []
            for draft, target in zip(drafts, targets):
                tokens.append(target)
                if target != draft:
                    return tokens
            return tokens + [targets[len(drafts)]]
        probs = filtered_probs(rows, s.sampling)
        tokens = []
        for i, draft in enumerate(drafts):
            gen = self._generator(s.sampling, s.num_output_tokens + i)
            accept = torch.rand((), generator=gen, device=self.device)
            if accept < probs[i, draft]:
                tokens.append(draft)
                continue
            residual = probs[i].clone()
            residual[draft] = 0.0
            tokens.append(draw(residual, gen))
            return tokens
        gen = self._generator(s.sampling, s.num_output_tokens + len(drafts))
        tokens.append(draw(probs[len(drafts)], gen))
        return tokens
