"""The demo's verdict logic on synthetic run directories with a planted effect."""

from __future__ import annotations

from rich.console import Console
from rundirs import calm

from servelab.analyze.answers import Question, answer
from servelab.report.terminal import render_answers
from servelab.rundir import load_run

Q = Question(
    "chunked_prefill",
    "Does it help?",
    ("overall", "itl", "p99"),
    ("overall", "ttft", "p50"),
    "off",
    "on",
    "on",
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

    from servelab.analyze.diagnose import diagnose
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


def test_longest_itl_per_request_sees_what_chunking_spreads(tmp_path):
    # One workload, chunked prefill off vs on: each chat stream's longest gap shrinks,
    # one value per request (a stall is one gap unchunked, several chunked).
    import random

    from rundirs import Engine, Req, chat_requests, write_run

    from servelab.analyze.answers import MAX_ITL, measure

    def run(name: str, chunked: bool):
        reqs = chat_requests(60, 8.0, 0, outputs=(40, 60))
        rng = random.Random(1)
        reqs += [
            Req(f"d{k}", "rag", 0.4 + 1.6 * k + rng.uniform(0, 0.1), 3000, 4) for k in range(4)
        ]
        eng = Engine(enable_chunked_prefill=chunked, max_num_batched_tokens=512)
        return load_run(write_run(tmp_path / name, reqs, eng, seed=0))

    off, on = run("off", False), run("on", True)
    m = measure([off], [on], ("chat", MAX_ITL, "mean"))
    assert m.label == "longest ITL per request mean (chat)"
    assert m.treatment_value < 0.7 * m.baseline_value
    assert m.p_value is not None and m.p_value < 0.05
