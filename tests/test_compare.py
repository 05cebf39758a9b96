"""compare: planted regressions are significant, same-config runs are noise, and
incomparable runs are flagged."""

from __future__ import annotations

import json

import numpy as np
import pytest
import rundirs

from servelab.analyze.compare import benjamini_hochberg, compare, permutation_pvalues
from servelab.rundir import load_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("cmp")
    return {
        "a": load_run(rundirs.calm(base / "a", noise_seed=0)),
        "b": load_run(rundirs.calm(base / "b", noise_seed=1)),
        "slow": load_run(rundirs.calm(base / "slow", noise_seed=2, slowdown=1.3)),
    }


def test_planted_30pct_regression_is_significant(runs):
    c = compare([runs["a"], runs["slow"]])
    for metric in ("ttft", "itl", "tpot", "e2e"):
        row = c.row(metric, "p50")
        assert row.delta[1] == pytest.approx(0.3, abs=0.1)
        assert row.significant[1] and row.verdict(1) == "worse"
    # The direction is read per metric: the regression is "better" seen from the slow side.
    assert compare([runs["slow"], runs["a"]]).row("ttft", "mean").verdict(1) == "better"


def test_same_config_runs_are_noise(runs):
    c = compare([runs["a"], runs["b"]])
    tested = [r for r in c.rows if r.significant[1] is not None]
    assert len(tested) >= 25
    assert not c.significant_rows(1)
    assert {r.verdict(1) for r in tested} == {"noise"}
    assert any("same server config" in n for n in c.notes)
    assert not c.warnings


def test_rates_get_a_verdict_only_with_repeats(runs, tmp_path):
    c = compare([runs["a"], runs["b"]])
    assert c.row("throughput.requests_per_s", "value").significant[1] is None
    fast = [load_run(rundirs.calm(tmp_path / f"f{i}", seed=i, noise_seed=i)) for i in range(3)]
    slow = [
        load_run(rundirs.calm(tmp_path / f"s{i}", seed=i, noise_seed=10 + i, slowdown=1.3))
        for i in range(3)
    ]
    g = compare([fast, slow], ["fast", "slow"])
    row = g.row("throughput.output_tokens_per_s", "value")
    assert row.p[1] is not None and len(g.labels) == 2


def test_workload_and_model_differences_warn(runs, tmp_path):
    other = load_run(rundirs.calm(tmp_path / "w", workload={"name": "other"}, model="llama-7b"))
    c = compare([runs["a"], other])
    text = " ".join(c.warnings)
    assert "workload spec differs" in text and "model" in text
    assert "name" in text  # names the differing key


def test_per_class_rows(tmp_path):
    a = load_run(rundirs.unchunked_stalls(tmp_path / "a"))
    b = load_run(rundirs.unchunked_stalls(tmp_path / "b"))
    c = compare([a, b])
    assert {r.scope for r in c.rows} == {"overall", "chat", "rag"}
    json.dumps(c.to_dict())


def test_permutation_pvalues_track_the_effect():
    rng = np.random.default_rng(0)
    x = rng.lognormal(0, 0.3, 200).tolist()
    same = rng.lognormal(0, 0.3, 200).tolist()
    shifted = (np.array(rng.lognormal(0, 0.3, 200)) * 1.3).tolist()
    p_same = permutation_pvalues((x, None), (same, None), n_perm=500)
    p_shift = permutation_pvalues((x, None), (shifted, None), n_perm=500)
    assert p_shift["p50"] < 0.01 and p_shift["mean"] < 0.01
    assert p_same["p50"] > 0.05 and p_same["mean"] > 0.05


def test_permutation_moves_whole_clusters():
    # Two clusters per side, each of 50 identical values: only 6 relabellings exist, so
    # no p-value can be below 1/3 however many values there are.
    a = ([1.0] * 50 + [1.1] * 50, [0] * 50 + [1] * 50)
    b = ([2.0] * 50 + [2.1] * 50, [0] * 50 + [1] * 50)
    assert min(permutation_pvalues(a, b, n_perm=300).values()) > 0.25


def test_benjamini_hochberg():
    adj = benjamini_hochberg([0.01, 0.04, 0.03, 0.5])
    # Sorted 0.01, 0.03, 0.04, 0.5 -> p * m / rank = 0.04, 0.06, 0.0533, 0.5 -> running min.
    assert adj == pytest.approx([0.04, 0.16 / 3, 0.16 / 3, 0.5])
    assert benjamini_hochberg([]) == []


def test_needs_two_runs(runs):
    with pytest.raises(ValueError, match="at least two"):
        compare([runs["a"]])
