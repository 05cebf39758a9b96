"""The simulated client sends a session's later turns as the real client does: the history in
the endpoint's own form (chat messages through the model's template, or joined text), so
the prefix cache of a replay meets the same tokens the server met."""

from __future__ import annotations

from servelab.bench.workloads.request_plan import PlannedRequest
from servelab.sim.loop.sim_requests import requests_from_plan
from servelab.vocab import RequestTags

SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n"
)


def _session(replies: list[str | None], carry: bool = True) -> list[PlannedRequest]:
    return [
        PlannedRequest(
            request_id=f"r{k}",
            index=k,
            tags=RequestTags(workload_class="c", session_id="s", turn=k),
            prompt=f"Question {k}: why is the sky blue?",
            prompt_tokens=10,
            max_tokens=5,
            carry_history=carry,
            reply=reply,
        )
        for k, reply in enumerate(replies)
    ]


def _turn(k: int) -> str:
    return f"<|im_start|>user\nQuestion {k}: why is the sky blue?<|im_end|>\n"


def test_recorded_replies_go_back_as_chat_messages_through_the_template(smollm_tok):
    plan = _session(["Rayleigh scattering.", "Shorter waves scatter more.", None])
    ids = [r.prompt_token_ids for r in requests_from_plan(plan, smollm_tok, "chat")]
    text = (
        SYSTEM
        + _turn(0)
        + "<|im_start|>assistant\nRayleigh scattering.<|im_end|>\n"
        + _turn(1)
        + "<|im_start|>assistant\nShorter waves scatter more.<|im_end|>\n"
        + _turn(2)
        + "<|im_start|>assistant\n"
    )
    assert ids[2] == smollm_tok.encode(text, add_special_tokens=False)
    # each turn's prompt holds the one before it, up to its assistant header
    assert ids[1][: len(ids[0])] == ids[0] and ids[2][: len(ids[1])] == ids[1]


def test_recorded_replies_go_back_as_joined_text_on_completions(smollm_tok):
    plan = _session(["Rayleigh scattering.", None])
    ids = [r.prompt_token_ids for r in requests_from_plan(plan, smollm_tok, "completions")]
    text = (
        "Question 0: why is the sky blue?Rayleigh scattering.\n\nQuestion 1: why is the sky blue?"
    )
    assert ids[1] == smollm_tok.encode(text, add_special_tokens=True)


def test_the_models_own_replies_are_its_output_ids_inside_the_clients_markup(smollm_tok):
    plan = _session([None, None])
    first, second = requests_from_plan(plan, smollm_tok, "chat", placeholder_ids=[1000])
    answer = [1000] * first.max_tokens
    n = len(first.prompt_token_ids) + len(answer)
    assert second.prompt_token_ids[:n] == first.prompt_token_ids + answer
    tail = smollm_tok.decode(second.prompt_token_ids[n:], skip_special_tokens=False)
    assert tail == "<|im_end|>\n" + _turn(1) + "<|im_start|>assistant\n"
    a, b = requests_from_plan(plan, smollm_tok, "completions", placeholder_ids=[1000])
    new = smollm_tok.encode("\n\nQuestion 1: why is the sky blue?", add_special_tokens=False)
    assert b.prompt_token_ids == a.prompt_token_ids + answer + new


def test_a_turn_without_history_is_still_a_chat_message(smollm_tok):
    plan = _session([None, None], carry=False)
    second = requests_from_plan(plan, smollm_tok, "chat")[1]
    text = SYSTEM + _turn(1) + "<|im_start|>assistant\n"
    assert second.prompt_token_ids == smollm_tok.encode(text, add_special_tokens=False)
