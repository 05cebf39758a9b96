"""What speculation and disaggregation cost a run beyond its latencies, from the server's
timelines: drafts proposed and accepted, and KV handed over between workers.

- ``acceptance(runs, scope)``: the drafts of one class (or ``"overall"``) over runs:
  acceptance rate = accepted / proposed draft tokens, mean accepted length = 1 + accepted /
  proposals (vLLM's definitions, so the figures read like its ``spec_decode`` counters).
  None where no request of the scope speculated.
- ``kv_transfers(runs)``: per handed-over request, the transfer's seconds, bytes and hand-off
  wait, and its share of the request's server-side TTFT; medians over runs. The transfer
  starts after the first token is out, so it lands in the first inter-token gap, not in TTFT:
  the share says how large it is beside TTFT. None where nothing was handed over.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from servelab.rundir import Run


@dataclass(frozen=True, kw_only=True)
class Acceptance:
    requests: int  # requests of the scope that speculated at least once
    proposals: int
    proposed: int  # draft tokens
    accepted: int

    @property
    def rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted / self.proposals if self.proposals else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.rate,
            "mean_accepted_length": self.mean_accepted_length,
        }


def acceptance(runs: list[Run], scope: str = "overall") -> Acceptance | None:
    requests = proposals = proposed = accepted = 0
    for run in runs:
        for rec in run.records:
            if not rec.ok or (scope != "overall" and rec.workload_class != scope):
                continue
            tl = run.timeline_for(rec)
            if tl is None or not tl.spec:
                continue
            requests += 1
            proposals += len(tl.spec)
            proposed += sum(s.proposed for s in tl.spec)
            accepted += sum(s.accepted for s in tl.spec)
    if not proposals:
        return None
    return Acceptance(requests=requests, proposals=proposals, proposed=proposed, accepted=accepted)


def kv_transfers(runs: list[Run]) -> dict[str, float] | None:
    seconds, waits, sizes, shares = [], [], [], []
    for run in runs:
        for tl in run.timelines.values():
            kv = tl.kv_transfer or {}
            if "seconds" not in kv or tl.first_token is None:
                continue
            seconds.append(kv["seconds"])
            waits.append(max(0.0, kv.get("handoff_wait", 0.0)))
            sizes.append(kv.get("bytes", 0))
            ttft = tl.first_token - tl.arrival
            if ttft > 0:
                shares.append(kv["seconds"] / ttft)
    if not seconds:
        return None
    return {
        "transfers": len(seconds),
        "transfer_ms_p50": 1e3 * statistics.median(seconds),
        "transfer_ms_max": 1e3 * max(seconds),
        "handoff_wait_ms_p50": 1e3 * statistics.median(waits),
        "mb_p50": statistics.median(sizes) / 1e6,
        "share_of_ttft_p50": statistics.median(shares) if shares else float("nan"),
    }
