"""The demo's verdict logic on synthetic run directories with a planted effect."""

from __future__ import annotations

import dataclasses
import random

from rich.console import Console
from rundirs import Engine, Req, calm, chat_requests, write_run

from servelab.analyze.answers import (
    MAX_ITL,
    Question,
    answer,
    disagg_answer,
    during_prefill,
    measure,
    spec_answer,
)
from servelab.report.terminal import render_answers
from servelab.rundir import load_run
from servelab.vocab import ClientRecord, SpecRecord
from servelab.workflows import demo

Q = Question(
    id="chunked_prefill",
    question="Does it help?",
    metric=("overall", "itl", "p99"),
    cost=("overall", "ttft", "p50"),
    baseline="off",
    treatment="on",
    treatment_effect="on",
)


def test_planted_2x_itl_p99_is_significant(tmp_path):
    # Every step twice as slow in the baseline: ITL p99 halves with the treatment.
    base = load_run(calm(tmp_path / "slow", seed=0, noise_seed=1, slowdown=2.0))
    treat = load_run(calm(tmp_path / "fast", seed=0, noise_seed=2))
    a = answer(Q, [base], [treat])
    assert a.key.treatment_value < 0.6 * a.key.baseline_value
    assert a.verdict == "significant" and a.key.p_value < 0.01
    assert a.answer.startswith("Yes")
    assert a.to_dict()["delta"] < -0.4


def test_equal_pair_is_noise(tmp_path):
    # One workload, two draws of machine noise: nothing to find.
    base = load_run(calm(tmp_path / "a", seed=0, noise_seed=1))
    treat = load_run(calm(tmp_path / "b", seed=0, noise_seed=2))
    a = answer(Q, [base], [treat])
    assert a.verdict == "noise" and a.key.p_value > 0.05
    assert "within the noise" in a.answer


def test_answers_fit_80_and_100_columns(tmp_path):
    base = load_run(calm(tmp_path / "slow", seed=0, noise_seed=1, slowdown=2.0))
    a = answer(Q, [base], [load_run(calm(tmp_path / "fast", seed=0, noise_seed=2))])
    for width in (80, 100):
        con = Console(width=width, record=True)
        render_answers([a], con)
        text = con.export_text()
        assert "…" not in text
        assert max(len(line) for line in text.splitlines()) <= width
        assert "significant" in text


def _no_cut(render, width: int) -> str:
    con = Console(width=width, record=True)
    render(con)
    text = con.export_text()
    assert "…" not in text, text
    return text


def test_tables_fit_80_and_100_columns(tmp_path):
    from rundirs import unchunked_stalls

    from servelab.analyze.diagnosis.diagnose import diagnose
    from servelab.analyze.summary import run_summary
    from servelab.report.terminal import fit, rates_table, render_diagnosis, render_summary

    run = load_run(unchunked_stalls(tmp_path / "u"))
    s = run_summary(run)
    d = diagnose(run)
    for width in (80, 100):
        _no_cut(lambda c: render_summary(run.name, s, c), width)
        _no_cut(lambda c: c.print(fit(rates_table(s), c, ["failed", "in tok/s"])), width)
        text = _no_cut(lambda c: render_diagnosis(d, c), width)
        # The attribution table keeps one line per part: no label wrapped word by word.
        table = text.split("Where TTFT went")[1].split("\n\n")[0]
        assert "server queueing" in table and "prefill compute" in table


def _rec(rid: str, cls: str, send: float, tokens: list[float]) -> ClientRecord:
    return ClientRecord(
        request_id=rid, workload_class=cls, intended_send=send, actual_send=send, chunk_times=tokens
    )


def test_during_prefill_keeps_the_streams_a_long_prompt_could_stall():
    rag = _rec("r", "rag", 10.0, [12.0, 12.1])  # prefill window [10, 12]
    recs = [
        rag,
        _rec("mid", "chat", 8.0, [9.0, 9.1, 12.3, 13.0]),  # decoding across the first token
        _rec("at", "chat", 8.0, [8.5, 9.0, 11.995]),  # its last token in the prefill's step
        # Ended while the prompt waited: the step that ended its prefill came after.
        _rec("ends", "chat", 8.0, [8.5, 9.0, 10.5]),
        _rec("before", "chat", 5.0, [5.5, 6.0, 9.5]),  # finished before the prompt was sent
        _rec("after", "chat", 12.5, [12.8, 13.0, 14.0]),  # started after the first token
        # Prefilled in the prompt's own step: its TTFT paid, its decode came after.
        _rec("shared", "chat", 10.0, [11.998, 12.1, 12.2]),
        _rec("one", "chat", 9.0, [11.0]),  # one token: no gap to stall
        _rec("lost", "rag", 9.0, []),  # a prompt that never got a token has no window
        _rec("code", "codegen", 8.0, [9.0, 13.0]),  # another class
    ]
    assert [r.request_id for r in during_prefill(recs, "chat", "rag")] == ["mid", "at"]
    assert during_prefill(recs, "chat", "batch") == []


def test_during_prefill_is_one_rule_applied_per_run(tmp_path):
    # A stream of run A and a prompt of run B never overlap, even where their times do:
    # each run has its own clock.
    from servelab.rundir import Run

    def run(name: str, records: list[ClientRecord]) -> Run:
        return Run(tmp_path / name, {}, records, {}, [])

    a = run("a", [_rec("c", "chat", 0.0, [1.0, 2.0, 5.0])])
    b = run("b", [_rec("c", "chat", 0.0, [1.0, 2.0, 5.0]), _rec("r", "rag", 3.0, [4.0, 4.1])])
    m = measure([a], [b], ("chat", MAX_ITL, "mean"), during="rag")
    assert m.counts == (0, 1)
    assert m.label == "longest ITL per request mean (chat decoding during a rag prefill)"
    # Too few such streams for any test: said in words, and no value where there was none.
    q = dataclasses.replace(Q, metric=("chat", MAX_ITL, "mean"), during="rag")
    ans = answer(q, [a], [b])
    assert ans.verdict == "noise" and ans.key.p_value is None
    assert ans.answer.startswith("Not shown: 1 and 0 chat streams were decoding during a rag")
    assert ans.to_dict()["baseline_value"] == {"value": None, "ci": None, "n": 0}


def test_longest_itl_per_request_sees_what_chunking_spreads(tmp_path):
    # One workload, chunked prefill off vs on: the longest gap of each chat stream decoding
    # while a long prompt was prefilled shrinks (a stall is one gap unchunked, several
    # chunked); the chats that ran after the last prompt are left out on both sides.
    import random

    from rundirs import Engine, Req, chat_requests, write_run

    def run(name: str, chunked: bool):
        reqs = chat_requests(60, 8.0, 0, outputs=(40, 60))
        reqs += chat_requests(10, 8.0, 1, outputs=(40, 60), prefix="late")
        for r in reqs[60:]:
            r.intended += 30.0
        rng = random.Random(1)
        reqs += [
            Req(f"d{k}", "rag", 0.4 + 1.6 * k + rng.uniform(0, 0.1), 3000, 4) for k in range(4)
        ]
        eng = Engine(enable_chunked_prefill=chunked, max_num_batched_tokens=512)
        return load_run(write_run(tmp_path / name, reqs, eng, seed=0))

    off, on = run("off", False), run("on", True)
    for r in (off, on):
        kept = {c.request_id for c in during_prefill(r.records, "chat", "rag")}
        assert kept and not any(k.startswith("late") for k in kept)
    m = measure([off], [on], ("chat", MAX_ITL, "mean"), during="rag")
    assert m.treatment_value < 0.5 * m.baseline_value
    assert m.p_value is not None and m.p_value < 0.05
    # Over every chat, the streams no prompt touched dilute the same contrast.
    pooled = measure([off], [on], ("chat", MAX_ITL, "mean"))
    assert pooled.counts[0] > m.counts[0]
    assert m.delta < pooled.delta
    q = dataclasses.replace(Q, metric=("chat", MAX_ITL, "mean"), during="rag")
    a = answer(q, [off], [on])
    assert a.verdict == "significant" and a.key.counts == m.counts
    assert f"over {m.counts[1]} and {m.counts[0]} such chat streams" in a.answer


def _mixed(path, seed: int, eng: Engine):
    """Chats decoding while rare 3000-token RAG prompts arrive (rundirs.unchunked_stalls's
    traffic), on the engine given."""
    reqs = chat_requests(60, 8.0, seed, outputs=(40, 60))
    rng = random.Random(seed + 1)
    reqs += [Req(f"d{k}", "rag", 0.4 + 1.6 * k + rng.uniform(0, 0.1), 3000, 4) for k in range(4)]
    return load_run(write_run(path, reqs, eng, seed=seed))


def test_disaggregation_pays_only_where_ttft_does_not_pay_for_it(tmp_path):
    q = demo.QUESTIONS["disaggregation"]
    colocated = _mixed(tmp_path / "co", 1, Engine(enable_chunked_prefill=False))
    # Decodes no longer stalled by the long prompts, TTFT as before: it pays.
    protected = _mixed(tmp_path / "ok", 1, Engine(max_num_batched_tokens=512))
    a = disagg_answer(q, [colocated], [protected])
    assert a.key.delta < -0.3 and a.verdict == "significant"
    assert a.extra["pays"] and a.answer.startswith("Yes")
    # More protection from a budget of 128 tokens, which TTFT pays for: it does not pay.
    dear = disagg_answer(
        q, [colocated], [_mixed(tmp_path / "dear", 1, Engine(max_num_batched_tokens=128))]
    )
    assert dear.cost.delta > 0 and dear.cost.p_value < 0.05
    assert not dear.extra["pays"] and dear.answer.startswith("No, not on this machine")
    # The colocated run's contention is stated, from its own stalls.
    assert dear.extra["phase_contention"]["decode_time_lost_to_prefill"] > 0.1


def _spec_run(path, seed: int, slowdown: float, drafts: bool):
    reqs = chat_requests(30, 3.0, seed, cls="edit", prefix="e")
    reqs += chat_requests(30, 3.0, seed + 7, cls="chat", prefix="c")
    eng = Engine(
        step_overhead=0.004 * slowdown, prefill_cost=0.0001 * slowdown, decode_cost=0.001 * slowdown
    )
    run = load_run(write_run(path, reqs, eng, seed=seed))
    if drafts:  # every edit step verified 4 drafts, 3 accepted; chat proposed and missed
        for rec in run.records:
            tl = run.timeline_for(rec)
            k = 3 if rec.workload_class == "edit" else 0
            tl.spec = [SpecRecord(step_id=0, proposed=4, accepted=k)]
    return run


def test_spec_answer_says_where_it_pays_and_where_it_does_not(tmp_path):
    q = dataclasses.replace(
        demo.QUESTIONS["spec_decode"], key_at="at concurrency 1", cost_at="at concurrency 8"
    )
    low = ([_spec_run(tmp_path / "a", 0, 2.0, False)], [_spec_run(tmp_path / "b", 0, 1.0, True)])
    high = ([_spec_run(tmp_path / "c", 5, 1.0, False)], [_spec_run(tmp_path / "d", 5, 1.0, True)])
    a = spec_answer(q, low, high)
    assert a.verdict == "significant" and a.key.delta < -0.3
    assert a.answer.startswith("Yes for edit at concurrency 1")
    assert "75% of drafts accepted" in a.answer and "0% of drafts accepted" in a.answer
    assert "for chat it does not pay" in a.answer
    assert a.key.label.endswith("at concurrency 1") and a.cost.label.endswith("at concurrency 8")
    assert a.extra["acceptance"]["edit_low"]["mean_accepted_length"] == 4.0
