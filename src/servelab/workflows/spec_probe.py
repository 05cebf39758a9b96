"""How many n-gram drafts a run's own traffic accepts, measured on a sample of its requests.

A run that did not speculate cannot say it: acceptance is a property of the text (how often
the output repeats its prompt or itself) and of the sampling (a sampled token matches a
draft less often than a greedy one). So for a run of the embedded engine ``servelab tune``
generates a sample of the run's own requests, in send order until ``output_tokens`` output
tokens are planned, on the run's model, weights and engine config with n-gram speculation at
``k`` drafts: each request with its own prompt ids and the temperature it was sent with (its
class's, else the run's ``--temperature``, else the server's default, 1.0) and its planned
output length up to ``PROBE_MAX_TOKENS``. The engine counts drafts proposed and accepted; the simulator's
per-draft acceptance (``sim.fit.asrun.acceptance_from_ratio``) is fitted to the accepted drafts
per drafted step, its proposal rate is the share of sequence-steps the n-gram lookup drafted
for (``sim.loop.sampled_proposals``), and the speculation candidates are priced with both.

The probe runs in a spawned process: the model's memory is returned when it ends, and the
tuning process, which forks its simulations, never starts torch's threads.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from servelab.engine.engine_config import EngineConfig
from servelab.sim.fit.asrun import acceptance_from_ratio

PROBE_K = 4
PROBE_OUTPUT_TOKENS = 1200
# Each request's output is cut here: the probe's steps are its longest output, so a few
# long ones would take the whole budget (about 30 ms a step here at 4-8 sequences).
PROBE_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 1.0  # the server's, where a request names none


@dataclass(frozen=True)
class ProbeRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float


@dataclass(frozen=True)
class AcceptanceProbe:
    """Drafts proposed and accepted over a sample of ``requests`` requests at ``k`` drafts."""

    k: int
    requests: int
    output_tokens: int
    asked: int  # sequence-steps the proposer was asked for drafts
    drafted: int  # of those, the ones it drafted for (the lookup matched)
    proposed: int
    accepted: int
    seconds: float

    @property
    def proposal_rate(self) -> float:
        """The share of a sequence's steps that got drafts."""
        return self.drafted / self.asked if self.asked else 0.0

    @property
    def acceptance(self) -> float:
        """The simulator's per-draft acceptance that gives as many accepted drafts per
        drafted step as the probe's (0 when nothing was drafted). The simulator drafts the
        policy's whole length over its repeating placeholders, where a real lookup often
        copies fewer (1.7 of 4 in a sampled code answer here), so the accepted tokens a
        drafted step gains are matched, and the verification of the drafts a real lookup
        would not have made is charged: an estimate on the side of caution."""
        if self.drafted <= 0:
            return 0.0
        return acceptance_from_ratio(self.accepted / (self.drafted * self.k), self.k)

    def describe(self) -> str:
        share = self.accepted / self.proposed if self.proposed else 0.0
        return (
            f"speculation probe: {self.requests} of the run's requests ({self.output_tokens} "
            f"output tokens) generated with n-gram speculation at {self.k} drafts: the lookup "
            f"matched in {self.proposal_rate:.0%} of the steps, and {self.accepted} of its "
            f"{self.proposed} drafts were accepted ({share:.0%}; per draft in order "
            f"{self.acceptance:.2f}); {self.seconds:.1f} s"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "requests": self.requests,
            "output_tokens": self.output_tokens,
            "asked": self.asked,
            "drafted": self.drafted,
            "proposal_rate": self.proposal_rate,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance": self.acceptance,
            "seconds": self.seconds,
        }


def sample(
    requests: list[Any],
    output_tokens: int = PROBE_OUTPUT_TOKENS,
    run_temperature: float | None = None,
) -> list[ProbeRequest]:
    """The first requests in send order (``sim.loop.simulation.SimRequest``s) until their planned
    outputs reach ``output_tokens``, each at the temperature the client sent: its class's,
    else ``run_temperature`` (the run's ``--temperature``), else the server's default."""
    fallback = DEFAULT_TEMPERATURE if run_temperature is None else float(run_temperature)
    out: list[ProbeRequest] = []
    planned = 0
    for r in sorted(requests, key=lambda r: r.send_time):
        if planned >= output_tokens:
            break
        t = r.tags.temperature
        n = min(int(r.max_tokens), PROBE_MAX_TOKENS)
        out.append(ProbeRequest(list(r.prompt_token_ids), n, fallback if t is None else float(t)))
        planned += n
    return out


class _Counted:
    """The engine's proposer, counting the sequence-steps it was asked for and those it
    drafted for."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.asked = self.drafted = 0

    def propose(self, batch: list[Any]) -> dict[str, list[int]]:
        drafts = self.inner.propose(batch)
        self.asked += len(batch)
        self.drafted += sum(1 for d in drafts.values() if d)
        return drafts

    def remove(self, request_id: str) -> None:
        self.inner.remove(request_id)


def _generate(
    model: str, quantization: str, engine: EngineConfig, k: int, reqs: list[ProbeRequest]
) -> tuple[int, int, int, int]:
    """(sequence-steps asked, drafted for, drafts proposed, accepted) over ``reqs`` on a
    fresh engine (runs in the probe's process)."""
    from servelab.engine.sampling_params import SamplingParams
    from servelab.model.build import build_engine

    # a pool for the sample, not the server's: allocating gigabytes costs seconds
    tokens = sum(len(r.prompt_token_ids) + r.max_tokens + k + 1 for r in reqs)
    cfg = dataclasses.replace(
        engine,
        speculative_config={"method": "ngram", "num_speculative_tokens": k},
        num_kv_blocks=tokens // engine.block_size + 2 * len(reqs) + 1,
    )
    llm = build_engine(model, cfg, threads=1, quantization=quantization)
    assert llm.spec is not None
    counted = llm.spec.proposer = _Counted(llm.spec.proposer)
    for i, r in enumerate(reqs):
        params = SamplingParams(
            max_tokens=r.max_tokens, temperature=r.temperature, ignore_eos=True, seed=i
        )
        llm.add_request(f"probe-{i}", prompt_token_ids=r.prompt_token_ids, sampling_params=params)
    proposed = accepted = 0
    while llm.has_unfinished():
        rec = llm.step().record
        proposed += rec.spec_proposed
        accepted += rec.spec_accepted
    return counted.asked, counted.drafted, proposed, accepted


def probe_acceptance(
    model: str,
    quantization: str,
    engine: EngineConfig,
    reqs: list[ProbeRequest],
    k: int = PROBE_K,
) -> AcceptanceProbe:
    """Generate ``reqs`` with ``k`` n-gram drafts on ``model`` with the run's ``engine``
    config (its KV pool sized for the sample), in a spawned process."""
    t0 = time.perf_counter()
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        asked, drafted, proposed, accepted = pool.submit(
            _generate, model, quantization, engine, k, reqs
        ).result()
    return AcceptanceProbe(
        k=k,
        requests=len(reqs),
        output_tokens=sum(r.max_tokens for r in reqs),
        asked=asked,
        drafted=drafted,
        proposed=proposed,
        accepted=accepted,
        seconds=time.perf_counter() - t0,
    )
