"""analyze.summary: SLOs, windows, percentiles with bootstrap CIs, throughput and goodput."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from client_records import client_records
from hypothesis import given, settings

from servelab.analyze.stats import describe
from servelab.analyze.summary import (
    bucket_label,
    measured_window,
    metric_values,
    summarize,
    summarize_group,
)
from servelab.units import SLO, Trim, parse_duration
from servelab.vocab import ClientRecord


def rec(
    i: int, send: float, ttft: float, gaps: list[float], cls: str = "chat", **kw
) -> ClientRecord:
    t = send + ttft
    times = [t]
    for g in gaps:
        t += g
        times.append(t)
    return ClientRecord(
        request_id=f"r{i}",
        workload_class=cls,
        intended_send=send,
        actual_send=send,
        chunk_times=times,
        chunk_tokens=[1] * len(times),
        output_tokens=len(times),
        done=times[-1],
        **kw,
    )


def test_parse_duration_and_slo():
    assert parse_duration("250ms") == pytest.approx(0.25)
    assert parse_duration("2s") == 2.0
    assert parse_duration("1.5min") == 90.0
    with pytest.raises(ValueError, match="unit"):
        parse_duration("250")
    slo = SLO.parse("ttft=2s, itl=250ms")
    assert slo.ttft == 2.0 and slo.itl == pytest.approx(0.25) and slo.e2e is None
    assert SLO.parse(None).empty
    with pytest.raises(ValueError, match="metrics: ttft"):
        SLO.parse("latency=2s")
    with pytest.raises(ValueError, match="METRIC=LIMIT"):
        SLO.parse("ttft")
    assert SLO.from_dict({"ttft": "500ms", "e2e": 3}) == SLO(ttft=0.5, e2e=3.0)
    assert SLO(ttft=1.0).merged(SLO(e2e=2.0)) == SLO(ttft=1.0, e2e=2.0)


def test_slo_met_semantics():
    r = rec(0, 0.0, 0.5, [0.1, 0.3, 0.1])
    assert SLO(ttft=0.6).met(r)
    assert not SLO(ttft=0.4).met(r)
    # ITL limit is against the largest gap of the request, not the mean
    assert not SLO(itl=0.2).met(r)
    assert SLO(itl=0.3).met(r)
    assert SLO(tpot=0.2).met(r)  # (1.0 - 0.5) / 3
    r.error = "timeout: 10s"
    assert not SLO().met(r)


def test_trim_parse():
    assert Trim.parse("10s") == Trim("seconds", 10.0)
    assert Trim.parse("20") == Trim("requests", 20.0)
    assert Trim.parse("5%") == Trim("percent", 5.0)
    assert Trim.parse(None).kind == "none"
    with pytest.raises(ValueError, match="percentage"):
        Trim.parse("abc")


def test_measured_window_rules():
    records = [rec(i, float(i), 0.1, [0.1]) for i in range(10)]  # sends 0..9, last done 9.2
    w = measured_window(records)
    assert (w.start, w.end) == (0.0, pytest.approx(9.2))
    w = measured_window(records, warmup="3", cooldown="2")
    assert (w.start, w.end) == (3.0, 8.0)
    w = measured_window(records, warmup="2.5s", cooldown="10%")
    assert (w.start, w.end) == (2.5, 9.0)
    with pytest.raises(ValueError, match="excludes all"):
        measured_window(records, warmup="10")
    with pytest.raises(ValueError, match="no measured window"):
        measured_window(records, warmup="5s", cooldown="5s")
    with pytest.raises(ValueError, match="no client records"):
        measured_window([])


def test_describe_matches_numpy_and_ci_brackets():
    rng = np.random.default_rng(1)
    x = rng.lognormal(0, 1, 2000)
    s = describe(x, seed=3)
    assert s.n == 2000
    for p in (50, 90, 95, 99):
        assert getattr(s, f"p{p}") == pytest.approx(np.percentile(x, p))
        lo, hi = s.ci[f"p{p}"]
        assert lo <= getattr(s, f"p{p}") <= hi
    assert s.max == x.max() and s.mean == pytest.approx(x.mean())
    assert describe(x, seed=3).ci == s.ci  # deterministic
    assert describe([]).n == 0 and describe([]).p50 is None
    assert describe([1.0, float("nan")]).n == 1


def test_bootstrap_ci_coverage_and_width():
    # The 95% CI of the median of N(0,1) samples should cover 0 in most trials,
    # and shrink as the sample grows.
    covered, widths = 0, {}
    for trial in range(40):
        x = np.random.default_rng(100 + trial).normal(size=400)
        lo, hi = describe(x, n_boot=300, seed=trial).ci["p50"]
        covered += lo <= 0.0 <= hi
    assert covered >= 34
    for n in (100, 3000):
        lo, hi = describe(np.random.default_rng(7).normal(size=n), n_boot=300).ci["p50"]
        widths[n] = hi - lo
    assert widths[3000] < widths[100] / 2


def test_cluster_bootstrap_is_wider_for_correlated_groups():
    # 30 requests whose gaps are all equal within a request: only 30 independent values.
    rng = np.random.default_rng(5)
    levels = rng.normal(size=30)
    vals = np.repeat(levels, 50)
    groups = np.repeat(np.arange(30), 50)
    iid = describe(vals, n_boot=400).ci["mean"]
    clustered = describe(vals, groups, n_boot=400).ci["mean"]
    assert (clustered[1] - clustered[0]) > 3 * (iid[1] - iid[0])


def test_bucket_labels():
    assert bucket_label(0) == "0-127"
    assert bucket_label(127) == "0-127"
    assert bucket_label(128) == "128-255"
    assert bucket_label(9000) == ">=8192"


def test_summarize_throughput_goodput_and_groups():
    records = []
    for i in range(10):
        cls = "rag" if i % 2 else "chat"
        r = rec(i, float(i), 0.2 if cls == "chat" else 0.8, [0.1] * 4, cls=cls)
        r.input_tokens = 100 if cls == "chat" else 600
        records.append(r)
    failed = ClientRecord(
        request_id="bad",
        workload_class="chat",
        intended_send=3.5,
        actual_send=3.5,
        error="http_500: boom",
        done=3.6,
    )
    records.append(failed)
    m = summarize(records, slos={"chat": SLO(ttft=0.5), "rag": SLO(ttft=0.5)}, n_boot=50)
    w = m["window"]
    assert w["start"] == 0.0 and w["end"] == pytest.approx(9 + 0.8 + 0.4)
    o = m["overall"]
    assert o["requests"] == {"sent": 11, "ok": 10, "failed": 1, "errors": {"http_500": 1}}
    dur = w["duration_s"]
    assert o["throughput"]["requests_per_s"] == pytest.approx(10 / dur)
    assert o["throughput"]["output_tokens_per_s"] == pytest.approx(50 / dur)
    assert o["throughput"]["input_tokens_per_s"] == pytest.approx((5 * 100 + 5 * 600) / dur)
    # Only chat requests meet ttft<=0.5s; the failed one never does.
    assert o["goodput"]["met"] == 5
    assert o["goodput"]["fraction"] == pytest.approx(5 / 11)
    assert m["by_class"]["rag"]["goodput"]["met"] == 0
    assert m["by_class"]["chat"]["latency"]["ttft"]["p50"] == pytest.approx(0.2)
    assert set(m["by_input_bucket"]) == {"0-127", "512-1023"}
    assert m["by_input_bucket"]["512-1023"]["latency"]["ttft"]["n"] == 5
    assert m["overall"]["latency"]["itl"]["n"] == 40
    assert m["overall"]["latency"]["tpot"]["p50"] == pytest.approx(0.1)


def test_summarize_window_counts_tokens_by_arrival():
    # One long request whose stream straddles the end of the window: only its
    # in-window tokens count toward output tokens/s.
    r = rec(0, 0.0, 0.5, [1.0] * 9)  # chunks at 0.5, 1.5, ..., 9.5
    short = rec(1, 1.0, 0.1, [0.1])  # done at 1.2
    m = summarize([r, short], cooldown="4.5s", n_boot=0)
    assert m["window"]["end"] == pytest.approx(5.0)
    # chunks of r at 0.5..4.5 (5 tokens) + 2 tokens of `short`
    assert m["overall"]["throughput"]["output_tokens_per_s"] == pytest.approx(7 / 5.0)
    assert m["overall"]["throughput"]["requests_per_s"] == pytest.approx(1 / 5.0)


def test_token_checks_reports_disagreements():
    a = rec(0, 0.0, 0.1, [0.1], requested_output_tokens=2, client_output_tokens=2)
    b = rec(1, 0.0, 0.1, [0.1], requested_output_tokens=5, client_output_tokens=3)
    m = summarize([a, b], n_boot=0)
    t = m["tokens"]
    assert t["usage_vs_client_disagreements"] == 1
    assert t["disagreement_examples"][0]["request_id"] == "r1"
    assert t["output_length_not_honoured"] == 1


def test_large_samples_use_woodruff_intervals_that_agree_with_the_bootstrap():
    from servelab.analyze.stats import BOOTSTRAP_MAX_N, _bootstrap

    rng = np.random.default_rng(11)
    n_req, per = 300, 40
    vals = np.repeat(rng.normal(size=n_req), per) + rng.normal(scale=0.5, size=n_req * per)
    groups = np.repeat(np.arange(n_req), per)
    assert vals.size > BOOTSTRAP_MAX_N
    big = describe(vals, groups)
    boot = _bootstrap(vals, groups, 0.95, 400, 0)
    for k in ("p50", "p90", "p99", "mean"):
        (lo, hi), (blo, bhi) = big.ci[k], boot[k]
        assert lo <= getattr(big, k) <= hi
        assert (hi - lo) == pytest.approx(bhi - blo, rel=0.35), k


# --- read once, select by index: equal to summarising each group's records afresh ------------


def _plain_woodruff(v, groups, confidence):
    """Each percentile selected on its own, the groups relabelled by np.unique."""
    from statistics import NormalDist

    from servelab.vocab import PERCENTILES

    z = NormalDist().inv_cdf(0.5 + confidence / 2.0)
    n = v.size
    g = None if groups is None else np.unique(np.asarray(groups), return_inverse=True)[1]

    def se_of(resid):
        if g is None:
            return float(np.sqrt((resid**2).sum() * n / max(n - 1, 1))) / n
        per = np.bincount(g, weights=resid)
        k = per.size
        return float(np.sqrt((per**2).sum() * k / max(k - 1, 1))) / n

    out = {}
    for p in PERCENTILES:
        q = p / 100.0
        xq = np.percentile(v, p)
        se = se_of((v <= xq).astype(np.float64) - q)
        lo, hi = max(0.0, q - z * se), min(1.0, q + z * se)
        out[f"p{p}"] = (float(np.quantile(v, lo)), float(np.quantile(v, hi)))
    m = float(v.mean())
    se = se_of(v - m)
    out["mean"] = (m - z * se, m + z * se)
    return out


@settings(max_examples=150, deadline=None)
@given(
    st.integers(2, 3000),
    st.integers(0, 2**32 - 1),
    st.sampled_from(["none", "sorted", "shuffled", "strings"]),
    st.booleans(),
)
def test_woodruff_intervals_equal_the_plain_ones(n, seed, grouping, rounded):
    from servelab.analyze.stats import _woodruff

    rng = np.random.default_rng(seed)
    v = rng.lognormal(size=n)
    if rounded:  # ties
        v = np.round(v, 1)
    groups = None
    if grouping != "none":
        groups = np.sort(rng.integers(0, max(n // 5, 1), n))
        if grouping == "shuffled":
            rng.shuffle(groups)
        elif grouping == "strings":
            groups = groups.astype(str)
    pcts = np.array([np.percentile(v, p) for p in (50, 90, 95, 99)])
    assert _woodruff(v, groups, 0.95, pcts) == _plain_woodruff(v, groups, 0.95)


def _plain_group(records, window, slo_of, **kw):
    """summarize_group as the definition: every metric read from the group's records."""
    from servelab.analyze.similarity import cache_hit_rate
    from servelab.analyze.summary import _error_kinds, _tokens_in_window
    from servelab.vocab import LATENCY_METRICS

    sent = [r for r in records if window.contains(r.actual_send)]
    ok = [r for r in sent if r.ok]
    good = [r for r in sent if slo_of(r).met(r)]
    completed = [r for r in records if r.ok and window.contains(r.done)]
    good_completed = [r for r in completed if slo_of(r).met(r)]
    dur = window.duration

    def rate(x):
        return x / dur if dur > 0 else None

    out_tokens = sum(_tokens_in_window(r, window) for r in records if r.ok)
    failed_out = sum(_tokens_in_window(r, window) for r in records if not r.ok)
    in_tokens = sum(r.input_tokens for r in completed)
    latency = {m: describe(*metric_values(ok, m), **kw).to_dict() for m in LATENCY_METRICS}
    return {
        "requests": {
            "sent": len(sent),
            "ok": len(ok),
            "failed": len(sent) - len(ok),
            "errors": _error_kinds(sent),
        },
        "throughput": {
            "requests_per_s": rate(len(completed)),
            "input_tokens_per_s": rate(in_tokens),
            "output_tokens_per_s": rate(out_tokens),
            "failed_output_tokens_per_s": rate(failed_out),
            "total_tokens_per_s": rate(in_tokens + out_tokens),
        },
        "goodput": {
            "requests_per_s": rate(len(good_completed)),
            "fraction": (len(good) / len(sent)) if sent else None,
            "met": len(good),
        },
        "latency": latency,
        "reasoning_tokens": sum(r.reasoning_tokens for r in ok),
        "prefix_cache_hit_rate": cache_hit_rate((r.cached_tokens, r.input_tokens) for r in ok),
    }


@settings(max_examples=150, deadline=None)
@given(
    client_records(max_size=40).filter(bool),
    st.sampled_from([None, "1", "10%"]),
    st.sampled_from([None, "5s", "2"]),
    st.sampled_from([{}, {"chat": "ttft=8s,itl=2s"}, {"rag": "e2e=20s", "chat": "itl=1s"}]),
    st.sampled_from([0, 50]),
)
def test_groups_read_once_equal_each_group_summarised_afresh(recs, warmup, cooldown, slos, n_boot):
    try:
        window = measured_window(recs, warmup, cooldown)
    except ValueError:
        return
    slo_map = {k: SLO.parse(v) for k, v in slos.items()}
    got = summarize(recs, window=window, slos=slo_map, n_boot=n_boot)
    kw = {"n_boot": n_boot, "seed": 0, "confidence": 0.95}

    def slo_of(r):
        return slo_map.get(r.workload_class, SLO())

    assert summarize_group(recs, window, slo_map, **kw) == _plain_group(recs, window, slo_of, **kw)
    want = _plain_group(recs, window, slo_of, **kw)
    want["prefix_reuse_ideal"] = None
    assert got["overall"] == want
    for cls in {r.workload_class for r in recs}:
        mine = [r for r in recs if r.workload_class == cls]
        assert got["by_class"][cls] == _plain_group(mine, window, slo_of, **kw) | {
            "prefix_reuse_ideal": None
        }
    for label, g in got["by_input_bucket"].items():
        mine = [r for r in recs if bucket_label(r.input_tokens) == label]
        assert g == _plain_group(mine, window, slo_of, **kw)
    assert got["counts"] == {
        "records": len(recs),
        "sent_in_window": sum(window.contains(r.actual_send) for r in recs),
        "ok": sum(r.ok for r in recs),
        "failed": sum(not r.ok for r in recs),
    }
