"""analyze.gaps: every record's ITL gaps in one array equal the records' own lists."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from client_records import client_records
from hypothesis import given, settings

from servelab.analyze.gaps import Gaps
from servelab.analyze.summary import metric_values


@settings(max_examples=200, deadline=None)
@given(client_records(max_size=30))
def test_flat_gaps_are_each_records_own(recs):
    gaps = Gaps.of(recs)
    assert gaps.counts.tolist() == [len(r.itls) for r in recs]
    for i, r in enumerate(recs):
        assert gaps.of_record(i) == r.itls
    # summed left to right, to the same float as Python's sum of each list
    assert gaps.record_sums == [sum(r.itls) for r in recs]


@settings(max_examples=200, deadline=None)
@given(client_records(max_size=30), st.data())
def test_pooled_gaps_of_a_group_are_its_metric_values(recs, data):
    idx = sorted(data.draw(st.sets(st.integers(0, max(len(recs) - 1, 0)))) & set(range(len(recs))))
    values, groups = Gaps.of(recs).pooled(np.array(idx, np.int64))
    want_values, want_groups = metric_values([recs[i] for i in idx], "itl")
    assert values.tolist() == want_values
    assert groups.tolist() == want_groups


def test_long_runs_are_read_and_summed_in_blocks(monkeypatch):
    import servelab.analyze.gaps as g
    from servelab.vocab import ClientRecord

    monkeypatch.setattr(g, "_BLOCK", 7)  # blocks of a record or a few
    rng = np.random.default_rng(0)
    recs = [
        ClientRecord(
            request_id=f"r{i}",
            workload_class="c",
            intended_send=0.0,
            actual_send=0.0,
            chunk_times=np.cumsum(rng.random(int(n))).tolist(),
        )
        for i, n in enumerate(rng.integers(0, 25, size=60))
    ]
    gaps = Gaps.of(recs)
    assert [gaps.of_record(i) for i in range(len(recs))] == [r.itls for r in recs]
    assert gaps.record_sums == [sum(r.itls) for r in recs]
