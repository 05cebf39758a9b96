"""``compare --fail-on``: fail a pipeline on a regression that is beyond a threshold *and*
significant, and say why for every rule.

Rules: ``"ttft.p99:+10%,goodput:-5%"``. A rule names a metric and a relative change; the sign
says which way is a regression (``+``: an increase beyond it, ``-``: a decrease beyond it;
without a sign, the metric's worse direction). Metrics:

- ``<latency>.<stat>``: ``ttft``, ``ttfo``, ``ttft_intended``, ``itl``, ``tpot``, ``e2e`` with
  ``p50``, ``p90``, ``p95``, ``p99`` or ``mean``: ``analyze.compare``'s rows, their
  significance the permutation test on per-request values, Benjamini-Hochberg adjusted
  across the pair's rows.
- ``goodput``: the fraction of requests that met every SLO of their class (failed requests
  miss), tested by the same permutation test on each request's met/missed.
- ``throughput.requests_per_s``, ``throughput.output_tokens_per_s``,
  ``goodput.requests_per_s``: one value per run, tested only across 3+ repeats per side
  (``compare``'s rule); with fewer, the rule reports "not tested" and never fails.

``gate(runs, comparison, rules)`` checks every run after the first against the first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from servelab.analyze.compare import DEFAULT_ALPHA, DEFAULT_N_PERM, Comparison, permutation_pvalues
from servelab.analyze.summary import run_summary
from servelab.rundir import Run
from servelab.units import SLO
from servelab.vocab import LATENCY_METRICS

_STATS = ("p50", "p90", "p95", "p99", "mean")
_RATES = {
    "throughput": "throughput.output_tokens_per_s",
    "throughput.requests_per_s": "throughput.requests_per_s",
    "throughput.output_tokens_per_s": "throughput.output_tokens_per_s",
    "goodput.requests_per_s": "goodput.requests_per_s",
}
GOODPUT = "goodput"
_RULE = re.compile(r"^\s*([a-z_.0-9]+)\s*:\s*([+-]?)\s*(\d+(?:\.\d+)?)\s*%\s*$")


@dataclass(frozen=True)
class Rule:
    """Fail when ``metric`` moves by more than ``limit`` (a fraction) in ``direction``."""

    text: str
    metric: str  # "ttft" / "goodput" / "throughput.requests_per_s"
    stat: str  # "p99" / "value"
    limit: float  # > 0
    direction: int  # +1: an increase is the regression, -1: a decrease

    @property
    def name(self) -> str:
        return self.metric if self.stat == "value" else f"{self.metric}.{self.stat}"


@dataclass(frozen=True)
class Verdict:
    rule: Rule
    label: str  # the run checked against the baseline
    failed: bool
    reason: str


def parse_rules(text: str) -> list[Rule]:
    """``"ttft.p99:+10%,goodput:-5%"`` -> rules; ValueError says what to write."""
    rules = []
    for part in (p for p in text.split(",") if p.strip()):
        m = _RULE.match(part.lower())
        if m is None:
            raise ValueError(
                f"{part.strip()!r}: write METRIC:+N% or METRIC:-N%, e.g. ttft.p99:+10%,goodput:-5%"
            )
        name, sign, pct = m.groups()
        if name in _RATES or name == GOODPUT:
            metric, stat, worse = _RATES.get(name, GOODPUT), "value", -1
        else:
            metric, _, stat = name.partition(".")
            if metric not in LATENCY_METRICS or stat not in _STATS:
                raise ValueError(
                    f"{name!r}: a metric is LATENCY.STAT ({', '.join(LATENCY_METRICS)} with "
                    f"{', '.join(_STATS)}), goodput, or {', '.join(sorted(_RATES))}"
                )
            worse = +1
        direction = {"+": 1, "-": -1}.get(sign, worse)
        rules.append(Rule(part.strip(), metric, stat, float(pct) / 100.0, direction))
    if not rules:
        raise ValueError("--fail-on names no rule; e.g. ttft.p99:+10%,goodput:-5%")
    return rules


def _met(run: Run) -> list[float]:
    """1.0 for each request of the run that met every SLO of its class, else 0.0."""
    slos = run_summary(run).get("slos") or {}
    lookup = {k: SLO.from_dict(v) for k, v in slos.items()}
    default = lookup.get("*", SLO())
    return [float(lookup.get(r.workload_class, default).met(r)) for r in run.records]


def _goodput(base: Run, other: Run, n_perm: int) -> tuple[float, float, float | None]:
    """The two runs' SLO-met fractions and the permutation p-value of their difference."""
    a, b = _met(base), _met(other)
    fa = sum(a) / len(a) if a else 0.0
    fb = sum(b) / len(b) if b else 0.0
    p = permutation_pvalues((a, None), (b, None), n_perm).get("mean")
    return fa, fb, p


def _fmt(metric: str, x: float | None) -> str:
    if x is None:
        return "-"
    if metric in LATENCY_METRICS:
        return f"{x * 1e3:,.1f} ms"
    if metric == GOODPUT:
        return f"{x:.1%}"
    return f"{x:,.2f}/s"


def gate(
    runs: list[Run],
    comparison: Comparison,
    rules: list[Rule],
    *,
    alpha: float = DEFAULT_ALPHA,
    n_perm: int = DEFAULT_N_PERM,
) -> list[Verdict]:
    """Each rule for each run after the first (module doc)."""
    out = []
    for i in range(1, len(runs)):
        label = comparison.labels[i]
        for rule in rules:
            base: float | None
            new: float | None
            if rule.metric == GOODPUT:
                base, new, p = _goodput(runs[0], runs[i], n_perm)
                delta = (new - base) / base if base else None
                significant = None if p is None else p <= alpha
            else:
                row = comparison.row(rule.metric, rule.stat)
                base, new = row.values[0], row.values[i]
                delta, p, significant = row.delta[i], row.p[i], row.significant[i]
            out.append(Verdict(rule, label, *_judge(rule, base, new, delta, p, significant)))
    return out


def _judge(
    rule: Rule,
    base: float | None,
    new: float | None,
    delta: float | None,
    p: float | None,
    significant: bool | None,
) -> tuple[bool, str]:
    limit = f"{'+' if rule.direction > 0 else '-'}{rule.limit:.0%}"
    head = f"{rule.name}: {_fmt(rule.metric, base)} -> {_fmt(rule.metric, new)}"
    if delta is None:
        return False, f"{head}: no change to measure (a value is missing)"
    change = f"{delta:+.1%}"
    beyond = delta * rule.direction > rule.limit
    if not beyond:
        return False, f"{head} ({change}): within {limit}"
    if significant is None:
        return False, (
            f"{head} ({change}): beyond {limit} but not tested (one value per run: "
            "give 3+ repeats per side, e.g. with servelab bench --matrix)"
        )
    if not significant:
        return False, f"{head} ({change}): beyond {limit} but within noise (p={p:.3g})"
    return True, f"{head} ({change}): beyond {limit} and significant (p={p:.3g}): REGRESSION"
