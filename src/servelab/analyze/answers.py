"""A question answered by one comparison: the key metric, its verdict, the cost, one sentence.

Each question names its key metric before the runs (``Question.metric``), so the verdict
is one pre-registered two-sided permutation test on the per-request values
(``compare.permutation_pvalues``, whole requests relabelled), not a row picked from a table
of a hundred: no multiple-comparison adjustment applies, and none is needed. The cost is
stated beside it with its own test where it is a latency, without one where it is a rate
(one value per run).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from servelab.analyze.compare import DEFAULT_ALPHA, permutation_pvalues
from servelab.analyze.diagnosis.attribution import attribute
from servelab.analyze.levers import SUSTAINED_DECODE_LOST, SUSTAINED_INTERFERENCE
from servelab.analyze.server_side.phase_costs import acceptance, kv_transfers
from servelab.analyze.stats import describe
from servelab.analyze.summary import metric_values, run_summary
from servelab.rundir import Run
from servelab.vocab import ClientRecord

# Each request's longest inter-token gap: the freeze a reader of that stream saw. Pooled ITL
# percentiles cannot judge chunked prefill: unchunked, one prompt makes one long gap per
# stream (often under 1% of the gaps, so p99 misses it); chunked, the same work makes several
# short ones (over 1%, so p99 lands on them), and p99 can come out higher with chunking.
MAX_ITL = "max_itl"  # ClientRecord.max_itl
_LABELS = {MAX_ITL: "longest ITL per request"}
# An extra sequence adding under this share of a one-sequence step: weight reads dominate
# the step (they are shared by the batch), as on a GPU at small batch sizes.
BANDWIDTH_BOUND_SHARE = 0.25
QUESTION_IDS = (
    "rag_ttft",
    "chunked_prefill",
    "priorities",
    "decode_itl",
    "spec_decode",
    "disaggregation",
)


@dataclass(frozen=True, kw_only=True)
class Question:
    id: str
    question: str
    metric: tuple[str, str, str]  # (scope, metric, stat): scope "overall" or a class
    cost: tuple[str, str, str]  # the same, or ("overall", "throughput", "output_tokens_per_s")
    baseline: str  # the configuration without the optimisation
    treatment: str
    treatment_effect: str  # what the treatment does, for the sentence: "with the cache"
    # The key metric's population, where the question is about some of the scope's requests
    # only: those decoding when a request of this class finished its prefill (``during_prefill``).
    during: str | None = None
    # Where the key and the cost were measured, where the two differ (other loads): "at
    # concurrency 1"; part of each metric's label.
    key_at: str | None = None
    cost_at: str | None = None


@dataclass(kw_only=True)
class Measured:
    """One metric on both sides: values, 95% CIs, relative delta, p-value (None: untested)."""

    scope: str
    metric: str
    stat: str
    baseline_value: float | None
    treatment_value: float | None
    baseline_ci: tuple[float, float] | None
    treatment_ci: tuple[float, float] | None
    delta: float | None
    p_value: float | None
    counts: tuple[int, int] = (0, 0)  # requests (runs, for a rate) measured on each side
    during: str | None = None  # the population filter (Question.during)
    at: str | None = None  # the load it was measured at, where the question names one

    @property
    def label(self) -> str:
        where = "" if self.scope == "overall" else f" ({self.scope})"
        if self.during:
            where = f" ({self.scope} decoding during a {self.during} prefill)"
        at = f" {self.at}" if self.at else ""
        return f"{_LABELS.get(self.metric, self.metric)} {self.stat}{where}{at}"


@dataclass(kw_only=True)
class Answer:
    question: Question
    key: Measured
    cost: Measured
    verdict: str  # "significant" | "noise"
    answer: str
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        q = self.question
        return {
            "id": q.id,
            "question": q.question,
            "metric": self.key.label,
            "baseline": q.baseline,
            "treatment": q.treatment,
            "baseline_value": {
                "value": self.key.baseline_value,
                "ci": self.key.baseline_ci,
                "n": self.key.counts[0],
            },
            "treatment_value": {
                "value": self.key.treatment_value,
                "ci": self.key.treatment_ci,
                "n": self.key.counts[1],
            },
            "delta": self.key.delta,
            "p_value": self.key.p_value,
            "verdict": self.verdict,
            "cost": asdict(self.cost) | {"metric": self.cost.label},
            "answer": self.answer,
            **self.extra,
        }


# Tokens of one engine step reach the client within a few ms of each other; a step of the
# CPU engine takes 40 ms or more. So a stream is "decoding when the prompt's prefill ended"
# if it was mid-stream this long before the prompt's first token: a stream prefilled in
# the prompt's own step, whose first token comes a hair before or after, is not.
SAME_STEP_S = 0.010


def during_prefill(records: list[ClientRecord], scope: str, other: str) -> list[ClientRecord]:
    """The ``scope`` requests of one run that were decoding when a request of class
    ``other`` finished its prefill: mid-stream (a token before and a token after)
    ``SAME_STEP_S`` before that request's first token.

    Client times only, so the rule is the same whatever the engine does. Every such stream
    waited through the step that ended the prompt's prefill: unchunked the whole prompt,
    chunked its last chunk. A stream that merely overlapped the prompt's wait [send, first
    token] is not kept: in a closed loop a prompt is sent as another stream ends, and
    streams that end in the step it waits for were never stalled (4 of 9 such streams in
    one unchunked demo run had a longest gap of 0.15-0.18 s, the others 1.65-3.6 s). A
    stream whose own prefill shared a step with the prompt is not one either (its TTFT
    paid, not its ITL)."""
    ends = [
        r.chunk_times[0] - SAME_STEP_S
        for r in records
        if r.workload_class == other and r.chunk_times
    ]
    return [
        r
        for r in records
        if r.workload_class == scope
        and len(r.chunk_times) > 1
        and any(r.chunk_times[0] < t <= r.chunk_times[-1] for t in ends)
    ]


def _records(group: list[Run], scope: str, during: str | None = None) -> list[ClientRecord]:
    out: list[ClientRecord] = []
    for run in group:
        recs = [r for r in run.records if r.ok]
        if during is not None:
            # Per run: a window and a stream overlap only on one run's clock.
            out += during_prefill(recs, scope, during)
        else:
            out += recs if scope == "overall" else [r for r in recs if r.workload_class == scope]
    return out


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not a else (b - a) / a


def measure(
    base: list[Run],
    treat: list[Run],
    spec: tuple[str, str, str],
    seed: int = 0,
    during: str | None = None,
    at: str | None = None,
) -> Measured:
    """``spec`` on both groups; a rate (``throughput``/``goodput``) is the mean over runs.
    ``during`` (a class) keeps only the scope's requests decoding during its prefills;
    ``at`` names the load, for the label."""
    scope, metric, stat = spec
    ci_a = ci_b = p = None
    if metric in ("throughput", "goodput"):
        a, b = (_mean_rate(g, metric, stat) for g in (base, treat))
        n = (len(base), len(treat))
        during = None  # a rate is the whole run's
    else:
        va = metric_values(_records(base, scope, during), metric)
        vb = metric_values(_records(treat, scope, during), metric)
        sa, sb = describe(*va, n_boot=400, seed=seed), describe(*vb, n_boot=400, seed=seed)
        a, b = getattr(sa, stat), getattr(sb, stat)
        p = permutation_pvalues(va, vb, seed=seed).get(stat)
        ci_a, ci_b = sa.ci.get(stat), sb.ci.get(stat)
        n = (_requests(va), _requests(vb))
    return Measured(
        scope=scope,
        metric=metric,
        stat=stat,
        baseline_value=a,
        treatment_value=b,
        baseline_ci=ci_a,
        treatment_ci=ci_b,
        delta=_delta(a, b),
        p_value=p,
        counts=n,
        during=during,
        at=at,
    )


def _requests(values: tuple[list[float], list[int] | None]) -> int:
    """How many requests gave values (pooled gaps carry their request's index)."""
    return len(set(values[1])) if values[1] is not None else len(values[0])


def _mean_rate(group: list[Run], section: str, key: str) -> float | None:
    xs = [(run_summary(r).get("overall") or {}).get(section, {}).get(key) for r in group]
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def fmt(m: Measured, v: float | None) -> str:
    """A value in the unit people read: ms for latencies, /s for rates."""
    if v is None:
        return "-"
    if m.metric in ("throughput", "goodput"):
        return f"{v:.1f} tok/s" if "tokens" in m.stat else f"{v:.2f} req/s"
    return f"{v * 1e3:.0f} ms"


def _with_ci(m: Measured, v: float | None, ci: tuple[float, float] | None) -> str:
    if ci is None or m.metric in ("throughput", "goodput"):
        return fmt(m, v)
    return f"{fmt(m, v)} [95% CI {ci[0] * 1e3:.0f}-{ci[1] * 1e3:.0f}]"


def _change(m: Measured) -> str:
    if m.delta is None:
        return "an unmeasured change"
    ratio = (m.treatment_value or 0) / m.baseline_value if m.baseline_value else None
    if ratio and (ratio >= 2 or ratio <= 0.5):
        return f"{ratio:.2g}x ({m.delta:+.0%})" if ratio >= 2 else f"{1 / ratio:.2g}x lower"
    return f"{m.delta:+.0%}"


def answer(
    q: Question,
    base: list[Run],
    treat: list[Run],
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    levels: tuple[int, int] | None = None,
) -> Answer:
    """Measure ``q``'s key metric and cost on baseline vs treatment and say what it found.

    ``levels`` (the lowest and highest concurrency) make it a batch-size question: the
    sentence then says what each extra sequence costs a step."""
    key = measure(base, treat, q.metric, seed, q.during)
    cost = measure(base, treat, q.cost, seed)
    significant = key.p_value is not None and key.p_value <= alpha
    verdict = "significant" if significant else "noise"
    vals = (
        f"{key.label} {_with_ci(key, key.treatment_value, key.treatment_ci)} {q.treatment_effect} "
        f"vs {_with_ci(key, key.baseline_value, key.baseline_ci)} without"
    )
    if q.during:
        # The population depends on the run: a verdict from two streams is not one from ten.
        vals += f", over {key.counts[1]} and {key.counts[0]} such {key.scope} streams"
    p_txt = "untested" if key.p_value is None else f"p = {key.p_value:.3g}"
    if significant:
        head = f"Yes: {_change(key)}, significant ({p_txt}); {vals}."
        if (key.delta or 0) > 0 and q.id != "decode_itl":
            head = f"No, it is worse: {_change(key)}, significant ({p_txt}); {vals}."
    elif q.during and key.p_value is None:
        # Fewer than two such streams on a side: nothing to relabel, so no test at all.
        head = (
            f"Not shown: {key.counts[1]} and {key.counts[0]} {key.scope} streams were decoding "
            f"during a {q.during} prefill, too few to compare."
        )
    else:
        head = (
            f"Not shown: the difference ({_change(key)}) is within the noise at this sample "
            f"size ({p_txt}); {vals}."
        )
    cost_txt = (
        f" Cost: {cost.label} {fmt(cost, cost.treatment_value)} vs "
        f"{fmt(cost, cost.baseline_value)} ({_change(cost)}"
        + ("" if cost.p_value is None else f", p = {cost.p_value:.3g}")
        + ")."
    )
    extra: dict[str, Any] = {}
    text = head + cost_txt
    if levels is not None:
        text, extra = _decode_answer(key, cost, levels, verdict, p_txt)
    return Answer(question=q, key=key, cost=cost, verdict=verdict, answer=text, extra=extra)


def _decode_answer(
    key: Measured, cost: Measured, levels: tuple[int, int], verdict: str, p_txt: str
) -> tuple[str, dict[str, Any]]:
    """Decode's sentence: what one extra sequence adds to a step, from ITL at the two ends
    (a step reads the weights once for the whole batch; compute grows per sequence)."""
    lo, hi = levels
    gain = (cost.treatment_value or 0) / cost.baseline_value if cost.baseline_value else 0.0
    text = (
        f"{key.label} goes from {fmt(key, key.baseline_value)} at concurrency {lo} to "
        f"{fmt(key, key.treatment_value)} at {hi} ({_change(key)}, {verdict}, {p_txt}), "
        f"while output throughput rises {gain:.1f}x"
    )
    if not key.baseline_value or key.treatment_value is None or hi <= lo:
        return text + ".", {}
    per_seq = (key.treatment_value - key.baseline_value) / (hi - lo)
    share = per_seq / key.baseline_value
    bound = (
        "so decode is bound by reading the weights, not by the batch's compute"
        if share < BANDWIDTH_BOUND_SHARE
        else "a large share of a step: on this machine decode is also compute-bound per "
        "sequence, so batching buys less than on a GPU"
    )
    text += (
        f": each extra sequence adds {per_seq * 1e3:.1f} ms ({share:.0%} of a one-sequence "
        f"step), {bound}."
    )
    return text, {"per_extra_sequence_s": per_seq, "share_of_step": share}


def _versus(m: Measured, treatment: str, baseline: str) -> str:
    """'<metric> X <treatment> vs Y <baseline> (change, p = ...)'."""
    p = "" if m.p_value is None else f", p = {m.p_value:.2g}"
    return (
        f"{m.label} {fmt(m, m.treatment_value)} {treatment} vs {fmt(m, m.baseline_value)} "
        f"{baseline} ({_change(m)}{p})"
    )


def _significant(m: Measured, alpha: float) -> bool:
    return m.p_value is not None and m.p_value <= alpha


def spec_answer(
    q: Question,
    low: tuple[list[Run], list[Run]],
    high: tuple[list[Run], list[Run]],
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
) -> Answer:
    """Speculation off vs on at a low and a high load: the key metric (the copy-heavy class
    at the low load, ``q.key_at``) where it should pay, the cost (the unpredictable class at
    the high load, ``q.cost_at``) where it should not, each with its own test, and the
    acceptance of each class at each load (``phase_costs.acceptance``)."""
    key = measure(*low, q.metric, seed, at=q.key_at)
    cost = measure(*high, q.cost, seed, at=q.cost_at)
    edit, chat = q.metric[0], q.cost[0]
    # The other two cells, for the sentence: the copying class batched, the other alone.
    edit_hi = measure(*high, (edit, *q.metric[1:]), seed, at=q.cost_at)
    acc = {
        f"{c}_{lvl}": a.to_dict()
        for lvl, treat in (("low", low[1]), ("high", high[1]))
        for c in (edit, chat)
        if (a := acceptance(treat, c)) is not None
    }

    def rate(cell: str) -> str:
        a = acc.get(cell)
        return "no drafts" if a is None else f"{a['acceptance_rate']:.0%} of drafts accepted"

    verdict = "significant" if _significant(key, alpha) else "noise"
    if verdict == "significant" and (key.delta or 0) < 0:
        head = f"Yes for {edit} {q.key_at}: {_versus(key, 'with n-gram', 'without')}, {rate(f'{edit}_low')}."
    elif verdict == "significant":
        head = f"No, it is worse even for {edit} {q.key_at}: {_versus(key, 'with', 'without')}."
    else:
        head = (
            f"Not shown for {edit} {q.key_at}: {_versus(key, 'with', 'without')}, within the noise."
        )
    at = q.cost_at or "batched"
    batched = f" {at[0].upper()}{at[1:]}, {edit} gets {_change(edit_hi)} ({rate(f'{edit}_high')})"
    if _significant(cost, alpha) and (cost.delta or 0) > 0:
        tail = (
            f"; {chat} pays: {_versus(cost, 'with', 'without')}, {rate(f'{chat}_high')}: "
            f"speculate only for traffic that copies its input."
        )
    elif _significant(cost, alpha):
        tail = f"; {chat} gains too: {_versus(cost, 'with', 'without')}, {rate(f'{chat}_high')}."
    else:
        tail = (
            f"; for {chat} it does not pay: {_versus(cost, 'with', 'without')}, "
            f"{rate(f'{chat}_high')}, no significant change."
        )
    extra = {"acceptance": acc, "key_at_high_load": asdict(edit_hi) | {"metric": edit_hi.label}}
    return Answer(
        question=q, key=key, cost=cost, verdict=verdict, answer=head + batched + tail, extra=extra
    )


def phase_contention(runs: list[Run]) -> dict[str, float]:
    """How much prefill and decode got in each other's way in colocated runs: interference's
    share of TTFT, and the excess of prefill-caused stalls as a share of all decode time."""
    interference = ttft = lost = gaps = 0.0
    for run in runs:
        attr = attribute(run)
        interference += sum(b.interference or 0.0 for b in attr.ttft)
        ttft += sum(b.ttft for b in attr.ttft)
        lost += sum(s.excess for s in attr.stalls if s.cause == "prefill")
        gaps += sum(sum(r.itls) for r in run.records if r.ok)
    return {
        "interference_share_of_ttft": interference / ttft if ttft else 0.0,
        "decode_time_lost_to_prefill": lost / gaps if gaps else 0.0,
    }


def disagg_answer(
    q: Question, base: list[Run], treat: list[Run], alpha: float = DEFAULT_ALPHA, seed: int = 0
) -> Answer:
    """Colocated vs disaggregated: it pays (pre-registered) only where the key metric (the
    decode streams a prefill could stall) is significantly lower and the cost (TTFT) not
    significantly higher. The sentence adds the KV hand-off per request and the colocated
    run's phase contention beside the level where splitting starts to pay."""
    key = measure(base, treat, q.metric, seed, q.during)
    cost = measure(base, treat, q.cost, seed)
    better = _significant(key, alpha) and (key.delta or 0) < 0
    dearer = _significant(cost, alpha) and (cost.delta or 0) > 0
    pays = better and not dearer
    kv = kv_transfers(treat)
    contention = phase_contention(base)
    head = "Yes" if pays else "No, not on this machine"
    text = (
        f"{head}: {_versus(key, 'split', 'colocated')}, over {key.counts[1]} and "
        f"{key.counts[0]} streams; {_versus(cost, 'split', 'colocated')}."
    )
    if kv is not None:
        text += (
            f" Each hand-off moved {kv['mb_p50']:.1f} MB of KV in {kv['transfer_ms_p50']:.0f} ms "
            f"(p50, {kv['share_of_ttft_p50']:.0%} of TTFT, paid in the first gap)."
        )
    i, lost = contention["interference_share_of_ttft"], contention["decode_time_lost_to_prefill"]
    text += (
        f" Colocated, interference was {i:.0%} of TTFT and prefill stalls {lost:.0%} of decode "
        f"time; splitting pays once that is sustained (>= {SUSTAINED_INTERFERENCE:.0%} and "
        f">= {SUSTAINED_DECODE_LOST:.0%}) and each role has compute of its own, not one "
        "shared core."
    )
    verdict = "significant" if _significant(key, alpha) else "noise"
    extra = {"pays": pays, "kv_transfer": kv, "phase_contention": contention}
    return Answer(question=q, key=key, cost=cost, verdict=verdict, answer=text, extra=extra)
