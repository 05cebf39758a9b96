"""Real-time simulation: an OpenAI-compatible server paced by the cost model."""

from __future__ import annotations

import itertools
import statistics
import time

import pytest

from servelab.engine.batch_plan import BatchPlan, ScheduledSeq
from servelab.engine.engine_config import EngineConfig
from servelab.engine.sampling_params import SamplingParams
from servelab.modelcore.tokenizer import Tokenizer
from servelab.server.server_args import ServerArgs
from servelab.sim.costs.executor import PacedExecutor
from servelab.sim.costs.work import StepWork
from servelab.sim.realtime import build_realtime_engine, build_target

SPEC = "l4:llama-3.1-8b"  # ~70 ms per decode step: long enough to measure through HTTP


def test_spec_forms_and_errors():
    t = build_target("h100:llama-3.1-70b:tp4", EngineConfig())
    assert t.info["tp"] == 4 and t.info["hardware"] == "h100"
    for bad in ("h100", "h100:llama-3.1-8b:4", "profile:"):
        with pytest.raises(ValueError, match="simulate"):
            build_target(bad, EngineConfig())


def test_paced_engine_sleeps_the_predicted_step_and_emits_words():
    tok = Tokenizer.from_model("smollm2-135m")
    engine = build_realtime_engine(SPEC, EngineConfig(), tok)
    assert isinstance(engine.executor, PacedExecutor)
    sp = SamplingParams(max_tokens=4, temperature=0.0)
    engine.add_request("a", prompt="Hello there", sampling_params=sp)
    text, starts = "", []
    while engine.has_unfinished():
        t0 = time.monotonic()
        res = engine.step()
        starts.append(time.monotonic() - t0)
        text += "".join(o.new_text for o in res.outputs)
    assert text.split()[:3] == ["the", "quick", "brown"]
    w = StepWork()
    w.add(1, 10, 1)
    decode = engine.executor.cost_model.predict(w)
    # Each step took at least its predicted time, and not much more.
    assert all(s >= decode * 0.99 for s in starts)
    assert statistics.median(starts) < decode * 2 + 0.05  # a busy machine wakes sleepers late


def test_plan_with_drafts_accepts_a_prefix_and_adds_one_token():
    tok = Tokenizer.from_model("smollm2-135m")
    engine = build_realtime_engine(SPEC, EngineConfig(), tok)
    seq = ScheduledSeq("x", [5], 10, [0], True, SamplingParams(), draft_token_ids=[7, 8, 9])
    out = engine.executor.execute(BatchPlan(0, [seq]))
    toks = out.sampled["x"]
    assert 1 <= len(toks) <= 4 and toks[:-1] == [7, 8, 9][: len(toks) - 1]


@pytest.mark.slow
def test_server_with_the_simulated_engine_answers_openai_with_simulated_timing():
    import openai
    from server_helpers import ServerThread

    server = ServerThread(ServerArgs(model="smollm2-135m", port=0, threads=1, simulate=SPEC))
    try:
        server.start()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        t0 = time.monotonic()
        stream = client.completions.create(
            model="smollm2-135m",
            prompt="Tell me a story about a fox.",
            max_tokens=12,
            stream=True,
            temperature=0.0,
        )
        arrivals, text = [], ""
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                arrivals.append(time.monotonic())
                text += chunk.choices[0].text
    finally:
        server.stop()
    assert "quick brown fox" in text
    target = build_target(SPEC, EngineConfig())
    w = StepWork()
    w.add(1, 20, 1)
    decode = target.cost_model.predict(w)
    itl = statistics.median(b - a for a, b in itertools.pairwise(arrivals))
    # The client sees the simulated decode step (plus HTTP and engine overhead).
    assert decode * 0.9 < itl < decode * 2 + 0.05
    assert arrivals[0] - t0 >= decode * 0.9  # the first token waited for a prefill step
