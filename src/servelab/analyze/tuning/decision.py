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
better"), so a knob is never both lowered and raised; objective gains within ``TIE`` of each
other are a tie, decided by the candidate's own target (chunk budgets of 64, 128 and 256
often all lift goodput to every SLO met, within a fraction of a point, while they cut the
longest ITL by 75% and 36%: without the rule that choice went to seed noise). The best of
each knob are ranked.
Candidates that add hardware (replicas) are listed apart as capacity, every replica count
that pays, since they buy their gain with machines rather than settings. :func:`combine`
merges the winners of several knobs into one candidate; when it is simulated too,
:func:`decide` takes it if it beats the best single setting.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from servelab.analyze.tuning.candidates import Candidate, Unpredicted
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

    def to_dict(self) -> dict[str, Any]:
        return {
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
    return Judged(cand, pred, og, tg, ok, why)


def combine(winners: Sequence[Judged]) -> Candidate | None:
    """One candidate that applies the best value of each knob at once (settings only, no
    hardware); None with fewer than two knobs."""
    parts = [j.candidate for j in winners if not j.candidate.hardware]
    if len(parts) < 2:
        return None
    engine: dict[str, Any] = {}
    prio: dict[str, int] = {}
    for c in parts:
        engine.update(c.engine)
        prio.update(c.priorities)
    return Candidate(
        id="+".join(c.id for c in parts),
        knob="combined",
        lever="+".join(c.lever for c in parts),
        title=" and ".join(c.title for c in parts),
        engine=engine,
        priorities=prio,
        findings=tuple(dict.fromkeys(f for c in parts for f in c.findings)),
        target=parts[0].target,
        cost="; ".join(c.cost for c in parts),
    )


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "objective": self.objective.to_dict(),
            "chosen": self.chosen.to_dict() if self.chosen else None,
            "ranked": [j.to_dict() for j in self.ranked],
            "capacity": [j.to_dict() for j in self.capacity],
            "rejected": [r.to_dict() for r in self.rejected],
            "unpredicted": [u.to_dict() for u in self.unpredicted],
        }


def objective_spread(j: Judged, objective: Objective) -> Spread | None:
    return j.prediction.spread(objective.scope, objective.figure)


def _key(j: Judged, objective: Objective) -> float:
    return j.objective_gain if j.objective_gain is not None else float("-inf")


def _tied(a: Judged, b: Judged, objective: Objective) -> bool:
    return abs(_key(a, objective) - _key(b, objective)) <= TIE


def _beats(a: Judged, b: Judged, objective: Objective) -> bool:
    """``a`` is the better value of one knob: the objective, then on a tie the target."""
    if not _tied(a, b, objective):
        return _key(a, objective) > _key(b, objective)
    low = float("-inf")
    return (a.target_gain if a.target_gain is not None else low) > (
        b.target_gain if b.target_gain is not None else low
    )


def decide(
    judged: Sequence[Judged],
    objective: Objective,
    unpredicted: Sequence[Unpredicted] = (),
    combined: Judged | None = None,
    top: int = TOP,
) -> Decision:
    """Reconcile the judged candidates into one decision (module doc)."""
    rejected: list[Rejected] = []
    best: dict[str, Judged] = {}
    capacity: list[Judged] = []
    for j in judged:
        if not j.recommendable:
            rejected.append(Rejected(j.candidate, j.reason))
            continue
        if j.candidate.hardware:
            capacity.append(j)
            continue
        knob = j.candidate.knob
        if knob not in best or _beats(j, best[knob], objective):
            if knob in best:
                rejected.append(_beaten(best[knob], j, objective))
            best[knob] = j
        else:
            rejected.append(_beaten(j, best[knob], objective))
    ranked = sorted(best.values(), key=lambda j: _key(j, objective), reverse=True)
    capacity.sort(key=lambda j: j.candidate.replicas)
    chosen = ranked[0] if ranked else None
    if combined is not None and chosen is not None:
        if combined.recommendable and _key(combined, objective) > _key(chosen, objective):
            rejected.append(_beaten(chosen, combined, objective))
            ranked.insert(0, combined)
            chosen = combined
        else:
            why = (
                combined.reason
                if not combined.recommendable
                else f"together predicted no better than {chosen.candidate.title} alone "
                f"({moved(combined.objective_gain, objective.figure)} vs "
                f"{moved(chosen.objective_gain, objective.figure)})"
            )
            rejected.append(Rejected(combined.candidate, why))
    return Decision(objective, chosen, ranked[:top], capacity, rejected, list(unpredicted))


def _beaten(loser: Judged, winner: Judged, objective: Objective) -> Rejected:
    c = winner.candidate
    fig = objective.figure
    if loser.candidate.knob == c.knob and _tied(winner, loser, objective):
        tfig = c.target[1]
        return Rejected(
            loser.candidate,
            f"ties on the objective with {c.title} ({moved(winner.objective_gain, fig)} vs "
            f"{moved(loser.objective_gain, fig)}), which improves its target more "
            f"({label(tfig)} {moved(winner.target_gain, tfig)} vs "
            f"{moved(loser.target_gain, tfig)})",
        )
    if loser.candidate.knob == c.knob:
        why = f"another value of the same knob is predicted better: {c.title}"
    else:
        why = f"{c.title} is predicted better"
    return Rejected(
        loser.candidate,
        f"{why} ({moved(winner.objective_gain, fig)} vs {moved(loser.objective_gain, fig)})",
    )
