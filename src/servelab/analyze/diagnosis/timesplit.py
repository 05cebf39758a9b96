"""Where the time went, for one answer: the figure a question is about, split into parts that
add up to it, for each configuration compared (an answer card's stacked bars).

Contract:
- ``TimeSplit.bars`` holds one ``(label, parts)`` per configuration, in the order given
  (baseline first); parts are seconds, under the same names in every bar (a part no bar
  has is dropped, one some bar has is 0.0 in the others), in ``TimeSplit.parts`` order.
- Each bar's parts add up to the mean it splits: ``ttft_split`` the mean TTFT from the
  intended send (attribution's parts), ``stall_split`` the mean longest inter-token gap of
  the key population, ``step_split`` the mean decode-only step, ``token_split`` the mean
  decode time per output token. A bar with no request to split has no parts.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from servelab.analyze.answers import during_prefill
from servelab.analyze.diagnosis.attribution import TTFT_PARTS, attribute
from servelab.rundir import Run
from servelab.vocab import ClientRecord

Groups = Sequence[tuple[str, list[Run]]]  # (label, the runs of one configuration)

TYPICAL_GAP = "typical gap (the stream's median)"
BELOW_THRESHOLD = "longer gap, not a stall"
STEP_ONE = "one-sequence step"
STEP_ADDED = "added by the other sequences"
SPEC_STEPS = "speculative steps"
PLAIN_STEPS = "plain decode steps"
BETWEEN_STEPS = "between steps"


@dataclass(frozen=True, kw_only=True)
class TimeSplit:
    title: str  # what the bars add up to
    parts: list[str]
    bars: list[tuple[str, dict[str, float]]]
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "parts": self.parts, "bars": self.bars, "note": self.note}


def _split(title: str, bars: list[tuple[str, dict[str, float]]], note: str = "") -> TimeSplit:
    parts = [p for p in dict.fromkeys(p for _, b in bars for p in b)]
    filled = [(label, {p: b.get(p, 0.0) for p in parts} if b else {}) for label, b in bars]
    return TimeSplit(title=title, parts=parts, bars=filled, note=note)


def _means(rows: list[dict[str, float]]) -> dict[str, float]:
    if not rows:
        return {}
    total: dict[str, float] = defaultdict(float)
    for row in rows:
        for k, v in row.items():
            total[k] += v
    return {k: v / len(rows) for k, v in total.items()}


def ttft_split(groups: Groups, scope: str = "overall") -> TimeSplit:
    """Mean TTFT (from the intended send) of the scope's streamed requests, by part."""
    bars = []
    for label, runs in groups:
        rows = []
        for run in runs:
            for b in attribute(run).ttft:
                if scope == "overall" or b.workload_class == scope:
                    rows.append({p: v for p, v in b.parts().items() if p in TTFT_PARTS})
        means = _means(rows)
        bars.append((label, {p: means[p] for p in TTFT_PARTS if means.get(p)}))
    where = "" if scope == "overall" else f" ({scope})"
    return _split(f"mean TTFT{where}, by where it went", bars)


def _longest_gap(rec: ClientRecord) -> tuple[float, float]:
    """(the longest gap, the chunk time it starts at)."""
    t = rec.chunk_times
    i = max(range(len(t) - 1), key=lambda k: t[k + 1] - t[k])
    return t[i + 1] - t[i], t[i]


def stall_split(groups: Groups, scope: str, during: str | None = None) -> TimeSplit:
    """Mean longest inter-token gap of the ``scope`` streams (with ``during``, those decoding
    during a ``during`` prefill: the key population of ``answers.during_prefill``): the
    stream's median gap, then the excess by the stall's cause (attribution), or as not a
    stall."""
    bars = []
    for label, runs in groups:
        rows = []
        for run in runs:
            ok = [r for r in run.records if r.ok]
            stalls = {(s.request_id, s.at): s for s in attribute(run).stalls}
            if during is not None:
                pop = during_prefill(ok, scope, during)
            else:
                pop = [r for r in ok if r.workload_class == scope and len(r.chunk_times) > 1]
            for rec in pop:
                gap, at = _longest_gap(rec)
                s = stalls.get((rec.request_id, at))
                if s is not None:
                    rows.append(
                        {TYPICAL_GAP: s.median_gap, f"stall: {s.cause}": gap - s.median_gap}
                    )
                else:
                    med = statistics.median(rec.itls)
                    rows.append({TYPICAL_GAP: med, BELOW_THRESHOLD: gap - med})
        bars.append((label, _means(rows)))
    which = f"{scope} stream during a {during} prefill" if during else f"{scope} stream"
    return _split(f"longest ITL per {which}, by cause", bars)


def _decode_steps(runs: list[Run]) -> list[float]:
    return [
        s.end - s.start for r in runs for s in r.steps if s.decode_seqs and not s.prefill_tokens
    ]


def step_split(groups: Groups) -> TimeSplit:
    """Mean decode-only step per configuration (concurrency levels, lowest first): the first
    configuration's step, and what the others add to it."""
    means = [statistics.fmean(d) if (d := _decode_steps(runs)) else None for _, runs in groups]
    one = means[0] if means else None
    bars: list[tuple[str, dict[str, float]]] = []
    for (label, _), m in zip(groups, means, strict=True):
        if m is None or one is None:
            bars.append((label, {}))
            continue
        bars.append((label, {STEP_ONE: min(one, m), STEP_ADDED: max(0.0, m - one)}))
    return _split("mean decode step (no prefill in it)", bars)


def token_split(groups: Groups, scopes: Sequence[str]) -> TimeSplit:
    """Mean decode time per output token of each group's requests of its class
    (``scopes[i]`` for ``groups[i]``, named in the bar's label): the steps that verified its
    drafts, its plain decode steps, and the time between its steps, each per token."""
    bars = []
    for (label, runs), scope in zip(groups, scopes, strict=True):
        rows = []
        for run in runs:
            step_time = {s.step_id: s.end - s.start for s in run.steps}
            steps_of: dict[str, list[int]] = defaultdict(list)
            for s in run.steps:
                for rid in s.decode:
                    steps_of[rid].append(s.step_id)
            for rec in run.records:
                if not rec.ok or rec.workload_class != scope:
                    continue
                tl = run.timeline_for(rec)
                if tl is None or tl.output_tokens < 2 or tl.decode_time <= 0:
                    continue
                spec_ids = {s.step_id for s in tl.spec}
                ids = steps_of.get(tl.request_id, [])
                spec = sum(step_time.get(i, 0.0) for i in ids if i in spec_ids)
                plain = sum(step_time.get(i, 0.0) for i in ids if i not in spec_ids)
                n = tl.output_tokens - 1
                between = max(0.0, tl.decode_time - spec - plain)
                rows.append(
                    {SPEC_STEPS: spec / n, PLAIN_STEPS: plain / n, BETWEEN_STEPS: between / n}
                )
        means = _means(rows)
        bars.append((f"{label} ({scope})", {k: v for k, v in means.items() if v}))
    return _split("decode time per output token", bars)
