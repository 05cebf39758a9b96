"""`compare`: several runs (or groups of repeated runs) side by side, with significance.

The first group is the baseline. For every latency metric x statistic, overall and per
workload class, each other group gets a delta and a permutation test on the raw
per-request values: requests of the two groups are pooled and relabelled at random
(whole requests, so the pooled ITL gaps of one request move together), and the p-value
is how often a relabelling moves the statistic at least as far as observed. The
p-values of one pair are adjusted with Benjamini-Hochberg across all its rows, so a
table of ~100 rows does not light up by chance. Rates (throughput, goodput) have one
value per run: they are tested across repeats when each side has at least 3, and are
otherwise shown without a verdict.

Comparability: the groups should share the workload spec and the model and differ in
server config; anything else yields a warning.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from itertools import combinations
from typing import Any

import numpy as np

from servelab.analyze.stats import describe
from servelab.analyze.summary import metric_values, run_summary
from servelab.rundir import Run
from servelab.vocab import LATENCY_METRICS, ClientRecord

STATS = ("p50", "p90", "p95", "p99", "mean")
RATES = (
    ("throughput", "requests_per_s"),
    ("throughput", "output_tokens_per_s"),
    ("goodput", "requests_per_s"),
)
DEFAULT_ALPHA = 0.05
DEFAULT_N_PERM = 2000
# Cap on values x relabellings per test, so a run with millions of pooled ITL gaps is
# compared in seconds: fewer relabellings (never below MIN_PERM) for bigger samples.
PERM_WORK = 2e8
MIN_PERM = 200
MIN_REPEATS_FOR_RATE_TEST = 3


@dataclass(kw_only=True)
class Row:
    scope: str  # "overall" or a workload class
    metric: str  # ttft | itl | ... | throughput.requests_per_s
    stat: str  # p50 | ... | value
    values: list[float | None]  # one per group
    ci: list[tuple[float, float] | None]
    delta: list[float | None]  # relative change vs the baseline (index 0 is None)
    p: list[float | None]  # BH-adjusted p-value vs the baseline
    significant: list[bool | None]  # None: not tested
    better: str  # "lower" | "higher"

    def verdict(self, i: int) -> str:
        """ "better" / "worse" (significant), "noise", or "" (not tested / baseline)."""
        if i == 0 or self.significant[i] is None:
            return ""
        if not self.significant[i]:
            return "noise"
        d = self.delta[i] or 0.0
        return "better" if (d < 0) == (self.better == "lower") else "worse"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"verdicts": [self.verdict(i) for i in range(len(self.values))]}


@dataclass(kw_only=True)
class Comparison:
    labels: list[str]
    rows: list[Row]
    configs: list[dict[str, Any]]
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def significant_rows(self, i: int = 1) -> list[Row]:
        return [r for r in self.rows if r.significant[i]]

    def row(self, metric: str, stat: str, scope: str = "overall") -> Row:
        for r in self.rows:
            if (r.scope, r.metric, r.stat) == (scope, metric, stat):
                return r
        raise KeyError(f"no row {scope}/{metric}/{stat}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "labels": self.labels,
            "configs": self.configs,
            "warnings": self.warnings,
            "notes": self.notes,
            "rows": [r.to_dict() for r in self.rows],
        }


# --- the permutation test -----------------------------------------------------------------


_QUANTILES = tuple((s, int(s[1:]) / 100.0) for s in STATS if s != "mean")


def _first_reaching(cum: np.ndarray, target: np.ndarray, complement: bool) -> np.ndarray:
    """Per row, the first index i where the running count reaches ``target[row]``.

    The running count is ``cum[row]`` (side A), or with ``complement`` the other side's
    ``i + 1 - cum[row, i]``; both never decrease, so a binary search run on all rows at
    once costs O(rows * log n) whatever n is.
    """
    rows = np.arange(len(cum))
    lo = np.zeros(len(cum), np.int64)
    hi = np.full(len(cum), cum.shape[1] - 1, np.int64)
    while (lo < hi).any():
        mid = (lo + hi) // 2
        count = cum[rows, mid]
        if complement:
            count = mid + 1 - count
        ok = count >= target
        hi = np.where(ok, mid, hi)
        lo = np.where(ok, lo, mid + 1)
    return lo


def _split_diffs(vs: np.ndarray, gs: np.ndarray, assign: np.ndarray) -> dict[str, np.ndarray]:
    """STATS(side A) - STATS(side B) for each row of ``assign`` (cluster -> 1 for A, 0 for B).

    ``vs`` is sorted, ``gs`` its cluster ids. A quantile is the first sorted value whose
    running count on that side reaches q * the side's count (the inverted-CDF definition).
    """
    n = len(vs)
    wa = assign[:, gs]
    cum_a = np.cumsum(wa, axis=1, dtype=np.int32)
    n_a = cum_a[:, -1].astype(float)
    sum_a = wa @ vs
    out = {}
    for s, q in _QUANTILES:
        ia = _first_reaching(cum_a, q * n_a, complement=False)
        ib = _first_reaching(cum_a, q * (n - n_a), complement=True)
        out[s] = vs[ia] - vs[ib]
    out["mean"] = sum_a / n_a - (float(vs.sum()) - sum_a) / (n - n_a)
    return out


def permutation_pvalues(
    a: tuple[list[float], list[int] | None],
    b: tuple[list[float], list[int] | None],
    n_perm: int = DEFAULT_N_PERM,
    seed: int = 0,
) -> dict[str, float]:
    """Two-sided permutation p-values for each of STATS, relabelling whole clusters.

    At most ``n_perm`` relabellings, fewer for large samples (see PERM_WORK).

    ``a`` and ``b`` are (values, cluster ids) as summary's metric extraction gives them
    (cluster ids None: every value is its own cluster).
    """
    va, ga = np.asarray(a[0], float), np.asarray(a[1] if a[1] is not None else range(len(a[0])))
    vb, gb = np.asarray(b[0], float), np.asarray(b[1] if b[1] is not None else range(len(b[0])))
    if len(va) < 2 or len(vb) < 2:
        return {}
    _, ga = np.unique(ga, return_inverse=True)
    _, gb = np.unique(gb, return_inverse=True)
    na = int(ga.max()) + 1
    v = np.concatenate([va, vb])
    g = np.concatenate([ga, gb + na])
    order = np.argsort(v, kind="stable")
    vs, gs = v[order], g[order]
    n_cl = int(g.max()) + 1
    labels = (np.arange(n_cl) < na).astype(np.int8)
    n_perm = min(n_perm, max(MIN_PERM, int(PERM_WORK // len(vs))))
    observed = {k: float(x[0]) for k, x in _split_diffs(vs, gs, labels[None, :]).items()}
    rng = np.random.default_rng(seed)
    hits = dict.fromkeys(STATS, 0)
    batch = max(1, 4_000_000 // len(vs))
    done = 0
    while done < n_perm:
        nb = min(batch, n_perm - done)
        assign = rng.permuted(np.tile(labels, (nb, 1)), axis=1)
        for k, d in _split_diffs(vs, gs, assign).items():
            # A relabelling "as extreme" as observed; the tolerance absorbs float noise on ties.
            hits[k] += int((np.abs(d) >= abs(observed[k]) - 1e-12).sum())
        done += nb
    return {k: (hits[k] + 1) / (n_perm + 1) for k in STATS}


def _exact_perm_p(a: list[float], b: list[float]) -> float:
    """Exact two-sided permutation p-value for a difference in means of small samples."""
    pooled = np.asarray(a + b, float)
    obs = abs(np.mean(a) - np.mean(b))
    n, k = len(pooled), len(a)
    hits = total = 0
    for chosen in combinations(range(n), k):
        mask = np.zeros(n, bool)
        mask[list(chosen)] = True
        total += 1
        hits += abs(pooled[mask].mean() - pooled[~mask].mean()) >= obs - 1e-12
    return hits / total


def benjamini_hochberg(p: list[float]) -> list[float]:
    """BH-adjusted p-values (monotone, capped at 1), in the input order."""
    if not p:
        return []
    arr = np.asarray(p, float)
    order = np.argsort(arr)
    m = len(arr)
    adj = arr[order] * m / np.arange(1, m + 1)
    adj = np.minimum.accumulate(adj[::-1])[::-1]
    out = np.empty(m)
    out[order] = np.minimum(adj, 1.0)
    return out.tolist()


# --- building the table -------------------------------------------------------------------


def _records(group: list[Run], scope: str) -> list[ClientRecord]:
    recs = [r for run in group for r in run.records if r.ok]
    return recs if scope == "overall" else [r for r in recs if r.workload_class == scope]


def _rate(run: Run, section: str, key: str) -> float | None:
    m = run_summary(run)
    return (m.get("overall") or {}).get(section, {}).get(key)


def _comparability(groups: list[list[Run]], labels: list[str]) -> tuple[list[str], list[str]]:
    warnings, notes = [], []
    first = groups[0][0]
    for label, g in zip(labels, groups):
        for run in g:
            if run.model != first.model:
                warnings.append(
                    f"{label}: model {run.model!r} differs from {first.model!r}: differences "
                    "mix the model with the server config"
                )
            if _canon(run.workload) != _canon(first.workload):
                keys = _diff_keys(first.workload, run.workload)
                warnings.append(
                    f"{label}: workload spec differs from {labels[0]}'s"
                    + (f" (in {', '.join(keys)})" if keys else "")
                    + ": these runs are not comparable as a config change"
                )
            if run.target_kind != first.target_kind or run.simulated != first.simulated:
                warnings.append(f"{label}: a different kind of target (simulated/real/other)")
            if not run.valid:
                warnings.append(f"{label}: run {run.name} is marked invalid: {run.invalid_reason}")
    configs = [_canon(g[0].engine_config) for g in groups]
    if len(set(configs)) == 1:
        notes.append(
            "All groups ran the same server config: any difference is noise or machine drift."
        )
    return list(dict.fromkeys(warnings)), notes


def _canon(x: Any) -> str:
    return json.dumps(x, sort_keys=True, default=str)


def _diff_keys(a: Any, b: Any) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return sorted(k for k in set(a) | set(b) if _canon(a.get(k)) != _canon(b.get(k)))
    return []


def compare(
    groups: list[list[Run]] | list[Run],
    labels: list[str] | None = None,
    *,
    alpha: float = DEFAULT_ALPHA,
    n_perm: int = DEFAULT_N_PERM,
    seed: int = 0,
) -> Comparison:
    """Compare groups of runs (a bare run is a group of one); the first is the baseline."""
    gs: list[list[Run]] = [g if isinstance(g, list) else [g] for g in groups]
    if len(gs) < 2:
        raise ValueError("compare needs at least two runs (or groups of runs)")
    labels = labels or [g[0].name if len(g) == 1 else f"{g[0].name} (+{len(g) - 1})" for g in gs]
    warnings, notes = _comparability(gs, labels)
    scopes = ["overall"] + sorted({r.workload_class for g in gs for run in g for r in run.records})
    if len(scopes) == 2:
        scopes = ["overall"]  # one class: its rows would repeat the overall ones
    rows: list[Row] = []
    raw_p: list[list[float | None]] = []
    for scope in scopes:
        for metric in LATENCY_METRICS:
            vals = [metric_values(_records(g, scope), metric) for g in gs]
            stats = [describe(v, grp, n_boot=400, seed=seed) for v, grp in vals]
            tests: list[dict[str, float]] = [{}]
            tests += [permutation_pvalues(vals[0], v, n_perm, seed) for v in vals[1:]]
            for s in STATS:
                values = [getattr(st, s) for st in stats]
                rows.append(
                    Row(
                        scope=scope,
                        metric=metric,
                        stat=s,
                        values=values,
                        ci=[st.ci.get(s) for st in stats],
                        delta=_deltas(values),
                        p=[None] * len(gs),
                        significant=[None] * len(gs),
                        better="lower",
                    )
                )
                row_p: list[float | None] = [None]
                raw_p.append(row_p + [t.get(s) for t in tests[1:]])
    for section, key in RATES:
        per_run = [[_rate(run, section, key) for run in g] for g in gs]
        values = [_mean(v) for v in per_run]
        row = Row(
            scope="overall",
            metric=f"{section}.{key}",
            stat="value",
            values=values,
            ci=[None] * len(gs),
            delta=_deltas(values),
            p=[None] * len(gs),
            significant=[None] * len(gs),
            better="higher",
        )
        rows.append(row)
        p: list[float | None] = [None]
        for v in per_run[1:]:
            a, b = [x for x in per_run[0] if x is not None], [x for x in v if x is not None]
            ok = min(len(a), len(b)) >= MIN_REPEATS_FOR_RATE_TEST
            p.append(_exact_perm_p(a, b) if ok else None)
        raw_p.append(p)
    for i in range(1, len(gs)):
        idx = [k for k, p in enumerate(raw_p) if p[i] is not None]
        pvals = [q for k in idx if (q := raw_p[k][i]) is not None]
        for k, adj in zip(idx, benjamini_hochberg(pvals)):
            rows[k].p[i] = adj
            rows[k].significant[i] = adj <= alpha
    notes.append(
        f"Significance: two-sided permutation test on per-request values (up to {n_perm} "
        f"relabellings), Benjamini-Hochberg adjusted across each pair's rows, alpha {alpha}."
    )
    if any(len(g) < MIN_REPEATS_FOR_RATE_TEST for g in gs):
        notes.append(
            "Throughput and goodput have one value per run: they get a verdict only with "
            f"{MIN_REPEATS_FOR_RATE_TEST}+ repeats per group (servelab bench --matrix)."
        )
    return Comparison(
        labels=labels,
        rows=rows,
        configs=[g[0].engine_config for g in gs],
        warnings=warnings,
        notes=notes,
    )


def _mean(v: list[float | None]) -> float | None:
    xs = [x for x in v if x is not None]
    return float(np.mean(xs)) if xs else None


def _deltas(values: list[float | None]) -> list[float | None]:
    base = values[0]
    out: list[float | None] = [None]
    for v in values[1:]:
        out.append(None if v is None or not base else (v - base) / base)
    return out
