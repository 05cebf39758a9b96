"""One decision from predicted candidates: rank by the objective, one value per knob.

The objective (:class:`Objective`) is goodput against the run's class SLOs by default, or,
for a run without SLOs, ``DEFAULT_FIGURE`` (overall E2E p95, lower is better); any figure
of ``analyze.tuning.prediction`` can be asked for, overall or for one class.

Every candidate is compared with the replay of the run as it ran under the same simulator
seeds (paired: seed i of both saw the same requests and the same noise series), on the
objective and on its own target figure. A candidate is *recommendable* when both improve:
the median over seeds of the paired relative change is a gain of at least ``MIN_GAIN``, and
at least ``AGREE`` of the seeds gain. Anything else is rejected with the reason (worse,
no gain, target not improved). Among the recommendable candidates of one knob only the
best survives (the others are rejected as "another value of the same knob is predicted
better"), so a knob is never both lowered and raised.

Ties (:func:`choose`) depend on the candidate set only, never on its order: every candidate
whose objective gain is within ``TIE`` of the best one's is tied with it, and of that group
the one with less to operate wins (``Candidate.operating_load``: its complexity, then how
many settings it applies at once), then the one that improves its own target more, then the
lowest id (natural order). Chunk budgets of 64, 128 and 256 often all lift goodput to every
SLO met within a fraction of a point while they cut the longest ITL by 75% and 36%: without
the rule that choice went to seed noise. (A rule that compared pairs in turn was not
transitive: +30.0/+30.8/+31.6% chose 256 in one order and 64 in the other.) The best of each
knob are ranked, and the chosen setting is picked from them by the same rule, so a smaller
gain with less to operate wins where gains tie, and :attr:`Decision.why` says so.
Candidates that add hardware (replicas) are listed apart as capacity, every replica count
that pays, since they buy their gain with machines rather than settings. :func:`combine`
merges the winners of several knobs into one candidate; when it is simulated too,
:func:`decide` takes it if it beats the best single setting.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from servelab.analyze.tuning.candidates import Candidate, Unpredicted, joint
from servelab.analyze.tuning.prediction import (
    HIGHER_IS_BETTER,
    Prediction,
    Spread,
    label,
    split_name,
)

DEFAULT_FIGURE = "e2e_p95"
MIN_GAIN = 0.02  # a predicted change smaller than this share of the figure is no gain
AGREE = 0.8  # share of paired seeds that must gain
TIE = MIN_GAIN / 2  # objective gains closer than this are a tie between values of one knob
TOP = 3


@dataclass(frozen=True)
class Objective:
    """What "better" means: ``figure`` of ``scope``, higher or lower is better."""

    figure: str
    scope: str = "overall"

    @classmethod
    def parse(cls, text: str | None, has_slos: bool) -> Objective:
        """``goodput`` | ``FIGURE`` | ``FIGURE@CLASS`` (e.g. ``ttft_p95@chat``); None: goodput
        where the run has SLOs, else ``DEFAULT_FIGURE``."""
        if not text:
            return cls("goodput" if has_slos else DEFAULT_FIGURE)
        figure, _, scope = text.strip().partition("@")
        figure = {"throughput": "output_tok_s"}.get(figure, figure)
        split_name(figure)  # ValueError naming the figures there are
        if figure in ("goodput", "attainment") and not has_slos:
            raise ValueError(
                f"--objective {text}: the run's workload has no SLOs to meet; give a figure "
                f"such as {DEFAULT_FIGURE} or ttft_p95@CLASS"
            )
        return cls(figure, scope or "overall")

    @property
    def higher_is_better(self) -> bool:
        return self.figure in HIGHER_IS_BETTER

    @property
    def text(self) -> str:
        where = "" if self.scope == "overall" else f" of {self.scope}"
        way = "higher" if self.higher_is_better else "lower"
        return f"{label(self.figure)}{where} ({way} is better)"

    def to_dict(self) -> dict[str, Any]:
        return {"figure": self.figure, "scope": self.scope, "text": self.text}


def paired_gains(base: Prediction, cand: Prediction, scope: str, figure: str) -> list[float]:
    """Per seed, the relative change of ``figure`` signed so that > 0 is better."""
    sign = 1.0 if figure in HIGHER_IS_BETTER else -1.0
    out = []
    for a, b in zip(base.values(scope, figure), cand.values(scope, figure), strict=False):
        if a is None or b is None:
            continue
        if a == 0:
            out.append(0.0 if b == 0 else sign * (1.0 if b > 0 else -1.0))
        else:
            out.append(sign * (b - a) / abs(a))
    return out


def _gain_verdict(gains: list[float]) -> tuple[float | None, bool, bool]:
    """(median gain, improves, worsens) over paired seeds."""
    if not gains:
        return None, False, False
    med = statistics.median(gains)
    share_up = sum(g > 0 for g in gains) / len(gains)
    share_down = sum(g < 0 for g in gains) / len(gains)
    return (
        med,
        med >= MIN_GAIN and share_up >= AGREE,
        med <= -MIN_GAIN and share_down >= AGREE,
    )


@dataclass
class Judged:
    """A candidate's prediction against the as-run replay."""

    candidate: Candidate
    prediction: Prediction
    objective_gain: float | None  # median paired relative gain (> 0 better)
    target_gain: float | None
    recommendable: bool
    reason: str  # why not, or what it gains
    pays: str = ""  # who pays for it: the class and figure predicted worst off

    def to_dict(self) -> dict[str, Any]:
        return {
            "pays": self.pays,
            "candidate": self.candidate.to_dict(),
            "objective_gain": self.objective_gain,
            "target_gain": self.target_gain,
            "recommendable": self.recommendable,
            "reason": self.reason,
        }


def moved(gain: float | None, figure: str) -> str:
    """A gain (> 0 better) as the figure itself moves: ``-43.2%`` for a latency cut by 43%."""
    if gain is None:
        return "n/a"
    return f"{(gain if figure in HIGHER_IS_BETTER else -gain):+.1%}"


def judge(base: Prediction, cand: Candidate, pred: Prediction, objective: Objective) -> Judged:
    """Whether ``cand`` improves the objective and its own target (module doc)."""
    og, o_up, o_down = _gain_verdict(paired_gains(base, pred, objective.scope, objective.figure))
    scope, fig = cand.target
    same = (scope, fig) == (objective.scope, objective.figure)
    tg, t_up, _ = (
        (og, o_up, o_down) if same else _gain_verdict(paired_gains(base, pred, scope, fig))
    )
    target = label(fig) + ("" if scope == "overall" else f" of {scope}")
    if o_down:
        ok, why = False, f"predicted worse: {objective.text} {moved(og, objective.figure)}"
    elif not o_up:
        ok, why = (
            False,
            f"no predicted gain on {objective.text} "
            f"({moved(og, objective.figure)} median over seeds)",
        )
    elif not t_up:
        ok, why = (
            False,
            (
                f"{objective.text} {moved(og, objective.figure)}, but its target, {target}, "
                f"is not predicted to improve ({moved(tg, fig)})"
            ),
        )
    else:
        ok, why = True, f"{objective.text} {moved(og, objective.figure)}; {target} {moved(tg, fig)}"
    return Judged(cand, pred, og, tg, ok, why, who_pays(base, pred))


# The latencies a candidate's cost is looked for in, per class.
PAID_IN = ("ttft_p50", "ttft_p95", "itl_p99", "tpot_p50", "e2e_p95")


def who_pays(base: Prediction, pred: Prediction) -> str:
    """The class (or all requests) and latency predicted to worsen most, by the paired rule
    of the objective (a median loss of ``MIN_GAIN`` in ``AGREE`` of the seeds)."""
    worst: tuple[float, str, str] | None = None
    for scope in base.scopes:
        for fig in PAID_IN:
            med, _, worse = _gain_verdict(paired_gains(base, pred, scope, fig))
            if worse and med is not None and (worst is None or med < worst[0]):
                worst = (med, scope, fig)
    if worst is None:
        return f"no class's latency is predicted worse by {MIN_GAIN:.0%} or more"
    med, scope, fig = worst
    who = "every request" if scope == "overall" else scope
    return f"{who}: {label(fig)} {moved(med, fig)}"


def combine(winners: Sequence[Judged]) -> Candidate | None:
    """One candidate that applies the best value of each knob at once (single settings only:
    no hardware, no pair); None with fewer than two knobs."""
    parts = [j.candidate for j in winners if not j.candidate.hardware and j.candidate.parts == 1]
    if len(parts) < 2:
        return None
    return joint(parts, "combined")


@dataclass
class Rejected:
    candidate: Candidate
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"candidate": self.candidate.to_dict(), "reason": self.reason}


@dataclass
class Decision:
    """``chosen`` is the one setting to apply (None: nothing is predicted to pay);
    ``ranked`` the best value of each knob, best first; ``capacity`` the hardware options
    that pay; the rest were rejected or could not be predicted."""

    objective: Objective
    chosen: Judged | None
    ranked: list[Judged]
    capacity: list[Judged]
    rejected: list[Rejected]
    unpredicted: list[Unpredicted] = field(default_factory=list)
    why: str = ""  # why ``chosen``: the best gain, or how a tie was decided

    def leaders(self, n: int = TOP) -> list[Judged]:
        """The chosen setting, then the next best distinct settings ranked: at most ``n``
        (what ``--verify`` measures beside the as-run config)."""
        if self.chosen is None:
            return []
        out = [self.chosen]
        for j in self.ranked:
            if len(out) >= n:
                break
            if all(j.candidate.id != o.candidate.id for o in out):
                out.append(j)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "objective": self.objective.to_dict(),
            "chosen": self.chosen.to_dict() if self.chosen else None,
            "why": self.why,
            "ranked": [j.to_dict() for j in self.ranked],
            "capacity": [j.to_dict() for j in self.capacity],
            "rejected": [r.to_dict() for r in self.rejected],
            "unpredicted": [u.to_dict() for u in self.unpredicted],
        }


def objective_spread(j: Judged, objective: Objective) -> Spread | None:
    return j.prediction.spread(objective.scope, objective.figure)


def _key(j: Judged) -> float:
    return j.objective_gain if j.objective_gain is not None else float("-inf")


def _natural(text: str) -> tuple[Any, ...]:
    """``chunk-64`` before ``chunk-128``: digits compare as numbers."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))


def _order(j: Judged) -> tuple[Any, ...]:
    """The total order within a tie: less to operate, a larger target gain, the id."""
    target = j.target_gain if j.target_gain is not None else float("-inf")
    return (*j.candidate.operating_load, -target, _natural(j.candidate.id))


def choose(group: Sequence[Judged]) -> tuple[Judged, list[Judged]]:
    """The winner of ``group`` and the candidates tied with it (module doc): a function of
    the set, whatever its order."""
    best = max(_key(j) for j in group)
    tied = [j for j in group if best - _key(j) <= TIE + 1e-12]
    winner = min(tied, key=_order)
    return winner, [j for j in tied if j is not winner]


def _why_tie(winner: Judged, loser: Judged, objective: Objective) -> str:
    """Why ``winner`` beat ``loser`` that it tied with on the objective."""
    w, c = winner.candidate, loser.candidate
    fig = objective.figure
    head = (
        f"ties on the objective with {w.title} ({moved(winner.objective_gain, fig)} vs "
        f"{moved(loser.objective_gain, fig)}), "
    )
    if w.operating_load < c.operating_load:
        return head + (
            f"which has less to operate ({w.complexity} complexity, {w.parts} setting(s), "
            f"vs {c.complexity}, {c.parts})"
        )
    tfig = w.target[1]
    if (winner.target_gain or 0.0) != (loser.target_gain or 0.0):
        return head + (
            f"which improves its target more ({label(tfig)} {moved(winner.target_gain, tfig)} "
            f"vs {moved(loser.target_gain, tfig)})"
        )
    return head + "and equals it on its target and what it takes to operate (the lower id wins)"


def decide(
    judged: Sequence[Judged],
    objective: Objective,
    unpredicted: Sequence[Unpredicted] = (),
    combined: Judged | None = None,
    top: int = TOP,
) -> Decision:
    """Reconcile the judged candidates into one decision (module doc); the same decision
    for every order of ``judged``."""
    rejected: list[Rejected] = []
    by_knob: dict[str, list[Judged]] = {}
    capacity: list[Judged] = []
    for j in judged:
        if not j.recommendable:
            rejected.append(Rejected(j.candidate, j.reason))
        elif j.candidate.hardware:
            capacity.append(j)
        else:
            by_knob.setdefault(j.candidate.knob, []).append(j)
    best: list[Judged] = []
    for group in by_knob.values():
        winner, tied = choose(group)
        best.append(winner)
        for j in group:
            if j is winner:
                continue
            rejected.append(
                Rejected(j.candidate, _why_tie(winner, j, objective))
                if any(t is j for t in tied)
                else _beaten(j, winner, objective)
            )
    ranked = sorted(best, key=lambda j: (-_key(j), _order(j)))
    capacity.sort(key=lambda j: j.candidate.replicas)
    chosen, why = None, ""
    if ranked:
        chosen, tied = choose(ranked)
        why = _why_chosen(chosen, tied, objective)
        ranked.remove(chosen)
        ranked.insert(0, chosen)
    if combined is not None and chosen is not None:
        pair = [chosen, combined] if combined.recommendable else [chosen]
        winner, _ = choose(pair)
        if winner is combined:
            rejected.append(_beaten(chosen, combined, objective))
            ranked.insert(0, combined)
            chosen = combined
            why = "the best knobs together are predicted better than any alone"
        else:
            if not combined.recommendable:
                reason = combined.reason
            elif _key(combined) > _key(chosen):
                reason = _why_tie(chosen, combined, objective)
            else:
                reason = (
                    f"together predicted no better than {chosen.candidate.title} alone "
                    f"({moved(combined.objective_gain, objective.figure)} vs "
                    f"{moved(chosen.objective_gain, objective.figure)})"
                )
            rejected.append(Rejected(combined.candidate, reason))
    rejected.sort(key=lambda r: (r.candidate.knob, _natural(r.candidate.id)))
    return Decision(objective, chosen, ranked[:top], capacity, rejected, list(unpredicted), why=why)


def _why_chosen(chosen: Judged, tied: Sequence[Judged], objective: Objective) -> str:
    """Why ``chosen`` is the decision: the best objective gain, or its place in a tie."""
    fig = objective.figure
    gain = moved(chosen.objective_gain, fig)
    if not tied:
        return f"the best predicted {objective.text}: {gain}"
    others = ", ".join(
        f"{j.candidate.title} {moved(j.objective_gain, fig)}" for j in sorted(tied, key=_order)
    )
    best = max([chosen, *tied], key=_key)
    if best is not chosen and chosen.candidate.operating_load < best.candidate.operating_load:
        lead = "a smaller gain with less to operate wins"
    else:
        lead = "chosen within the tie by less to operate, then its own target"
    return (
        f"{gain}, tied within {TIE:.0%} with {others}; {lead} "
        f"({chosen.candidate.complexity} complexity, {chosen.candidate.parts} setting(s))"
    )


def _beaten(loser: Judged, winner: Judged, objective: Objective) -> Rejected:
    c = winner.candidate
    fig = objective.figure
    if loser.candidate.knob == c.knob:
        why = f"another value of the same knob is predicted better: {c.title}"
    else:
        why = f"{c.title} is predicted better"
    return Rejected(
        loser.candidate,
        f"{why} ({moved(winner.objective_gain, fig)} vs {moved(loser.objective_gain, fig)})",
    )
