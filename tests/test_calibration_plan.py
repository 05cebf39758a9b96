"""`servelab calibrate --plan`: the ladder of short runs against a live server that spans what
will be predicted (prompt lengths, streams, a shared prefix), and the twin fitted to it, whose
attention-pair price carries a prefill cost growing faster than linearly with the prompt.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from servelab.analyze.server_side.stepinfer import InferredStep, SeqWork, StepInference
from servelab.cli import app
from servelab.report.ladder_tables import ladder_table
from servelab.sim.fit.twin import TwinCalibration, fit_steps
from servelab.workflows.calibration_plan import ladder, prompt_price, top_prompt


def test_the_plan_is_a_ladder_of_prompts_streams_and_a_shared_prefix():
    rungs = ladder(2048, (1, 2, 4, 8))
    assert [r.name for r in rungs] == [
        "warmup",
        *(f"prefill-{n}" for n in (64, 128, 256, 512, 1024, 2048)),
        *(f"decode-c{c}" for c in (1, 2, 4, 8)),
        "decode-long-c4",
        "prefix",
    ]
    prefill = [r for r in rungs if r.kind == "prefill"]
    assert {(r.concurrency, r.output) for r in prefill} == {(1, 8)}  # alone, short answers
    decode = {r.concurrency: r for r in rungs if r.kind == "decode"}
    assert decode[8].requests == 16 and decode[8].output > decode[8].prompt - 1
    # several long contexts decoding at once, each stream one request: the price of reading
    # a context a prediction of long prompts at load will ask for
    long = rungs[-2]
    assert (long.prompt, long.concurrency, long.requests) == (1024, 4, 4)
    assert long.output == decode[8].output
    prefix = rungs[-1]
    assert prefix.shared == 1024 and prefix.requests > 1 and prefix.prompt <= 2048
    assert rungs[0].prompt == 2048  # the warm-up checks the longest prompt first
    # a short top starts from a quarter of it, and ends exactly at it
    assert [r.prompt for r in ladder(100, (2,)) if r.kind == "prefill"] == [25, 50, 100]
    assert [r.name for r in ladder(64, (2, 1, 2)) if r.kind == "decode"] == [
        "decode-c1",
        "decode-c2",
        "decode-long-c2",
    ]
    assert ladder(64, (8, 16))[-2].name == "decode-long-c8"  # none up to 4: the fewest
    # the server's context caps the top, and says so
    assert top_prompt(None, None) == (2048, None)
    assert top_prompt(4096, 8192) == (4096, None)
    top, note = top_prompt(None, 1024)
    assert top == 1000 and note is not None and "1024" in note
    with pytest.raises(ValueError, match="too short"):
        top_prompt(64, 20)
    out = io.StringIO()
    Console(file=out, width=100).print(ladder_table([asdict(r) for r in rungs]))
    assert "prefill-2048" in out.getvalue() and "warmup (not fitted)" in out.getvalue()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--plan"], "--plan measures a live server: give its --url"),
        (["--plan", "--url", "localhost:8000"], "give a base URL"),
        (["--plan", "--url", "http://127.0.0.1:9", "--max-prompt", "4"], "--max-prompt 4: give"),
        (["--plan", "--url", "http://127.0.0.1:9", "--concurrency", "1,x"], "--concurrency"),
        (["--plan", "--url", "http://127.0.0.1:9", "--concurrency", "0"], "--concurrency"),
        (["--plan", "--url", "http://127.0.0.1:9", "somerun"], "drop the run directories"),
        (["--plan", "--url", "http://127.0.0.1:9"], "cannot reach http://127.0.0.1:9"),
        (["--url", "http://127.0.0.1:9"], "--url measures a live server: add --plan"),
        ([], "give a run directory, or --plan"),
    ],
)
def test_bad_plan_flags_are_one_line_errors(args, says):
    r = CliRunner().invoke(app, ["calibrate", *args])
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in r.output


PLANTED = {"step": 0.004, "decode_seqs": 0.001, "prefill_tokens": 2e-4, "attn_pairs": 5e-8}


def _steps(rng: np.random.Generator) -> StepInference:
    """Back-to-back steps shaped as the ladder's: each prompt alone then its decodes, and
    decode batches at several stream counts, timed by the planted prices with 3% noise."""
    batches: list[list[SeqWork]] = []
    for n in (64, 128, 256, 512, 1024, 2048):
        for rep in range(2):
            rid = f"p{n}-{rep}"
            batches.append([SeqWork(rid, n, 0, True)])
            batches += [[SeqWork(rid, 1, n + k, True)] for k in range(7)]
    for c in (1, 2, 4, 8):
        batches += [[SeqWork(f"d{c}-{j}", 1, 64 + k, True) for j in range(c)] for k in range(32)]
    steps, t = [], 0.0
    for seqs in batches:
        n = sum(s.new_tokens for s in seqs if not (s.new_tokens == 1 and s.context_before))
        pairs = sum(s.new_tokens * s.context_before + s.new_tokens * (s.new_tokens + 1) / 2
                    for s in seqs)  # fmt: skip
        decodes = sum(1 for s in seqs if s.new_tokens == 1 and s.context_before)
        cost = (
            PLANTED["step"]
            + PLANTED["decode_seqs"] * decodes
            + PLANTED["prefill_tokens"] * n
            + PLANTED["attn_pairs"] * pairs
        )
        end = t + cost * float(rng.lognormal(0.0, 0.03))
        steps.append(InferredStep(end=end, start=t, arrival=None, seqs=seqs))
        t = end
    return StepInference(steps=steps, tolerance=0.001, prefill_of={}, diagnostics={})


def test_a_planted_quadratic_prefill_cost_is_recovered_from_ladder_shaped_steps():
    fit = fit_steps([_steps(np.random.default_rng(7))], bootstrap=0)
    # the price of an attention pair, and what it makes of a long prompt in 512-token chunks
    assert fit.coef["attn_pairs"] == pytest.approx(PLANTED["attn_pairs"], rel=0.15)
    cal = TwinCalibration(
        server="other", model="m", engine_config={"max_num_batched_tokens": 512},
        engine_sources={}, max_model_len=4096, kv_bytes_per_token=1.0, cost=fit.coef,
        bootstrap=[], noise=None, api_overhead_s=0.01, fit={},
    )  # fmt: skip
    n = 2048
    pairs = n * (n + 1) / 2  # the chunks' pairs add up to the whole prompt's
    planted = 0.01 + 4 * PLANTED["step"] + PLANTED["prefill_tokens"] * n
    planted += PLANTED["attn_pairs"] * pairs
    priced, attn = prompt_price(cal, n)
    assert priced == pytest.approx(planted, rel=0.05)
    assert attn == pytest.approx(PLANTED["attn_pairs"] * pairs, rel=0.15)
    assert attn / priced > 0.15  # the growth with length is a real part of the price


def test_a_small_ladder_against_a_live_server_writes_a_twin_spanning_it(tmp_path):
    from servelab.testing.testserver import Schedule, run_test_server

    steps = {"base": 0.004, "per_decode": 0.001, "per_prefill_token": 1e-4, "max_seqs": 8}
    sched = Schedule(steps=steps, report="none", metrics="missing")
    out = tmp_path / "ladder"
    with run_test_server(sched) as url:
        r = CliRunner().invoke(
            app,
            ["calibrate", "--plan", "--url", url, "--model", "test-model", "--max-prompt", "32",
             "--concurrency", "1,2", "--out", str(out)],
        )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "the ladder should take about" in r.output and "[7/7] prefix" in r.output
    plan = json.loads((out / "plan.json").read_text())
    assert [g["name"] for g in plan["rungs"]] == [
        "warmup", "prefill-8", "prefill-16", "prefill-32", "decode-c1", "decode-c2",
        "decode-long-c2", "prefix",
    ]  # fmt: skip
    cal = TwinCalibration.load(out / "twin.json")
    assert cal.fit["runs"] == 7 and "warmup" not in cal.run  # the warm-up is not fitted
    assert cal.domain is not None
    assert cal.domain["prompt_tokens"][1] >= 32  # the ladder's longest prompt is inside
    assert cal.domain["in_flight"] == [1, 2]
    assert cal.fit["error_on_training_steps"]["median"] < 0.1
    # the plan's directory given to calibrate counts as its seven rungs (a run from another
    # launch would go beside it)
    again = tmp_path / "again.json"
    r = CliRunner().invoke(
        app, ["calibrate", str(out), "--model", "test-model", "--out", str(again)]
    )
    assert r.exit_code == 0, r.output
    assert TwinCalibration.load(again).fit["runs"] == 7
