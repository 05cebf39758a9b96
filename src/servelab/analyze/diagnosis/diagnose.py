"""`diagnose(run)`: why the percentiles are what they are.

Pure function from a loaded run to a `Diagnosis`: the TTFT attribution aggregated
(overall, per class, and over the slowest 10%), ITL stalls by cause, findings with
evidence and confidence, and recommendations. Every figure carries whether it is exact
(a servelab target's own timelines) or an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servelab.analyze.diagnosis.attribution import (
    CLIENT_PARTS,
    EXACT_PARTS,
    TTFT_PARTS,
    Attribution,
    TTFTBreakdown,
    attribute,
)
from servelab.analyze.diagnosis.findings import Context, Finding, find_all
from servelab.analyze.levers import Recommendation, recommend
from servelab.analyze.server_side.promscrape import ServerEstimates, estimate, parse_scrapes
from servelab.analyze.server_side.timeseries import server_series
from servelab.analyze.summary import run_timeslices
from servelab.rundir import LACKS_TOKEN_TIMES, Run

TAIL_QUANTILE = 90

# How each TTFT part is obtained, per attribution source.
_PART_SOURCE = {
    "exact": dict.fromkeys(EXACT_PARTS, "exact"),
    "summary": {
        "client_lag": "exact",
        "network_http": "exact",
        "queue": "exact",
        "prefill": "exact (includes interference)",
    },
    "reported": {
        "client_lag": "exact",
        "connection": "exact (the client's clock: a new connection's set-up, ~0 when kept)",
        "sending": "exact (the client's clock: connection -> the request's last byte written)",
        "network_http": "exact (request written -> the server's queue entry, and first-token "
        "delivery)",
        "queue": "exact (the server's per-request figure)",
        "prefill": "exact (the server's per-request figure; includes interference)",
    },
    "client": {
        "client_lag": "exact",
        "connection": "exact (the client's clock: a new connection's set-up, ~0 when kept)",
        "sending": "exact (the client's clock: connection -> the request's last byte written)",
    },
}


@dataclass
class PartsTable:
    """Mean seconds per TTFT part over a set of requests, and each part's share."""

    n: int
    ttft_mean: float
    parts: dict[str, float]

    @property
    def shares(self) -> dict[str, float]:
        total = sum(self.parts.values())
        return {k: (v / total if total > 0 else 0.0) for k, v in self.parts.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "ttft_mean": self.ttft_mean,
            "parts": self.parts,
            "shares": self.shares,
        }


@dataclass
class Diagnosis:
    run_name: str
    target_kind: str
    source: str  # exact | summary | client | mixed | none
    part_sources: dict[str, str]
    overall: PartsTable | None
    tail: PartsTable | None
    by_class: dict[str, PartsTable]
    stalls_by_cause: dict[str, dict[str, float]]
    findings: list[Finding]
    recommendations: list[Recommendation]
    notes: list[str] = field(default_factory=list)
    estimates: ServerEstimates | None = None
    attribution: Attribution | None = None  # per-request detail
    server_series: dict[str, Any] | None = None  # the /metrics time series, summarised
    timeslices: dict[str, Any] | None = None  # per-window figures and the steady-state verdict

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run_name,
            "target_kind": self.target_kind,
            "source": self.source,
            "part_sources": self.part_sources,
            "ttft_attribution": {
                "overall": self.overall.to_dict() if self.overall else None,
                f"slowest_{100 - TAIL_QUANTILE}pct": self.tail.to_dict() if self.tail else None,
                "by_class": {k: v.to_dict() for k, v in self.by_class.items()},
            },
            "itl_stalls_by_cause": self.stalls_by_cause,
            "findings": [f.to_dict() for f in self.findings],
            "recommendations": [r.to_dict() for r in self.recommendations],
            "server_estimates": self.estimates.to_dict() if self.estimates else None,
            "server_series": self.server_series,
            "timeslices": self.timeslices,
            "notes": self.notes,
            "requests": [b.to_dict() for b in self.attribution.ttft] if self.attribution else [],
            "itl_stalls": [s.to_dict() for s in self.attribution.stalls]
            if self.attribution
            else [],
        }


def _table(rows: list[TTFTBreakdown], keys: list[str]) -> PartsTable | None:
    if not rows:
        return None
    parts = {k: float(np.mean([getattr(r, k) or 0.0 for r in rows])) for k in keys}
    return PartsTable(len(rows), float(np.mean([r.ttft for r in rows])), parts)


def _estimated_parts(est: ServerEstimates, rows: list[TTFTBreakdown]) -> dict[str, float]:
    """Run-level split from /metrics means: only what those histograms can say."""
    out: dict[str, float] = {}
    client_ttft = float(np.mean([r.ttft for r in rows]))
    q, p, t = est.mean("queue"), est.mean("prefill"), est.mean("ttft")
    server_ttft = t if t is not None else (q + p if q is not None and p is not None else None)
    if server_ttft is not None:
        out["network_http"] = client_ttft - server_ttft
    if q is not None:
        out["queue"] = q
    if p is not None:
        out["prefill"] = p
    elif server_ttft is not None and q is not None:
        out["prefill"] = server_ttft - q
    return out


def diagnose(run: Run) -> Diagnosis:
    attr = attribute(run)
    foreign = run.target_kind != "servelab" or not run.timelines
    parsed = parse_scrapes(run.scrapes) if foreign else []
    est = estimate(run.scrapes, parsed) if foreign else None
    series = server_series(parsed)
    ctx = Context(run=run, attr=attr, est=est, series=series)
    findings = find_all(ctx)
    recs = recommend(ctx, findings)
    rows = attr.ttft
    notes: list[str] = []
    source = attr.source
    part_sources = dict(_PART_SOURCE.get(source, {}))
    if not any(b.connection is not None for b in rows):  # a run recorded before the split
        for part in CLIENT_PARTS:
            part_sources.pop(part, None)
        if source == "reported":
            part_sources["network_http"] = (
                "exact (send -> the server's queue entry, and first-token delivery)"
            )
    if source == "reported" and any(b.queue is None for b in rows):
        part_sources.pop("queue")
        part_sources["network_http"] = "exact (includes queueing: the server gave no queue figure)"
    keys = [k for k in TTFT_PARTS if k in part_sources] or ["client_lag"]
    overall = _table(rows, keys)
    tail = None
    by_class: dict[str, PartsTable] = {}
    if rows:
        cut = float(np.percentile([r.ttft for r in rows], TAIL_QUANTILE))
        tail = _table([r for r in rows if r.ttft >= cut], keys)
        for cls in sorted({r.workload_class for r in rows}):
            t = _table([r for r in rows if r.workload_class == cls], keys)
            if t is not None:
                by_class[cls] = t
    if source == "client":
        if est is not None and overall is not None:
            for k, v in _estimated_parts(est, rows).items():
                overall.parts[k] = v
                part_sources[k] = "estimate (/metrics histogram means)"
            if "network_http" in overall.parts:  # the client's own parts are measured
                for part in CLIENT_PARTS:
                    overall.parts["network_http"] -= overall.parts.get(part, 0.0)
            notes.append(
                "This target is not servelab: per-request figures are client-side only; the "
                "server split is an estimate from /metrics histogram deltas over the run, and "
                "interference cannot be separated from prefill."
            )
        else:
            notes.append(
                "No server timelines and no /metrics scrapes: only the client's own lag"
                + (", connection and sending are" if "connection" in part_sources else " is")
                + " attributed; the rest of TTFT is one unexplained server+network figure."
            )
    elif source == "reported":
        by = {(r.server_timeline or {}).get("reported_by", "") for r in run.records} - {
            "",
            "ignored",
        }
        notes.append(
            f"Per-request server figures from {', '.join(sorted(by))}: queue and prefill are the "
            "server's own; interference from other requests is included in prefill."
        )
    elif source == "summary":
        notes.append(
            "Only the per-request phase summary was available (no server.jsonl/steps.jsonl): "
            "interference from other requests is included in prefill."
        )
    if attr.cost is not None:
        notes.append(
            f"Step cost model fitted on {attr.cost.n_steps} steps (R² {attr.cost.r2:.2f}): "
            f"{attr.cost.prefill_per_token * 1e3:.3f} ms per prefill token, "
            f"{attr.cost.decode_per_seq * 1e3:.2f} ms per decoding sequence, "
            f"{attr.cost.overhead * 1e3:.1f} ms per step; prefix-cache savings and gains are "
            "estimated from it."
        )
    if foreign and series is None:
        notes.append(
            "No /metrics time series (fewer than two usable scrapes): stall causes rest on "
            "client times alone."
        )
    imported = run.manifest.get("imported")
    if imported:
        version = f" {imported['version']}" if imported.get("version") else ""
        notes.append(f"Imported from {imported.get('tool')}{version} ({imported.get('file')}).")
    if LACKS_TOKEN_TIMES in run.lacks:
        notes.append(
            "Its tool kept each request's first and last token times, not every token's: "
            "TTFT, TPOT and E2E are exact; ITL, its stalls and the engine's steps cannot be "
            "seen."
        )
    if run.skipped_lines:
        notes.append(f"{run.skipped_lines} truncated line(s) skipped (the run ended mid-write).")
    if not run.valid:
        notes.append(f"The benchmark marked this run invalid: {run.invalid_reason}")
    stalls: dict[str, dict[str, float]] = {}
    for s in attr.stalls:
        d = stalls.setdefault(s.cause, {"count": 0, "excess_seconds": 0.0})
        d["count"] += 1
        d["excess_seconds"] += s.excess
    return Diagnosis(
        run_name=run.name,
        target_kind=run.target_kind,
        source=source,
        part_sources=part_sources,
        overall=overall,
        tail=tail,
        by_class=by_class,
        stalls_by_cause=stalls,
        findings=findings,
        recommendations=recs,
        notes=notes,
        estimates=est,
        attribution=attr,
        server_series=series.to_dict() if series is not None else None,
        timeslices=run_timeslices(run, series),
    )
