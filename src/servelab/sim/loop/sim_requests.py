"""Turn a benchmark plan or a trace into the simulated client's requests.

Workloads go through the benchmark's own planner (``bench.plan.build_plan``), so a
simulated run and a real run of the same workload, load and seed send the same
prompts at the same times; the prompt text is tokenized as the server would, so
shared prefixes hit the prefix cache exactly where they would for real.

Traces are read and scaled by the benchmark's ``bench.workloads.traces`` functions, but their
prompts are made of synthetic token ids (text for 19,366 long prompts would cost more
than the simulation): a request's first tokens are unique to it, so no two requests
share a KV block unless the trace says so (Mooncake ``hash_ids``: equal ids give equal
blocks of ``block_tokens`` tokens).
"""

from __future__ import annotations

from typing import Any, cast

from servelab.bench.workloads.request_plan import compose_prompt
from servelab.sim.loop.history import Resend
from servelab.sim.loop.simulation import SimRequest
from servelab.vocab import RequestTags

_FILLER = 13  # any id: after a unique first block, the chained block hashes differ anyway
_SPAN = 30_000  # ids below every vocabulary servelab knows


def _unique_head(key: int) -> list[int]:
    return [1 + key % _SPAN, 1 + (key // _SPAN) % _SPAN, 1 + key // (_SPAN * _SPAN)]


def synthetic_ids(key: int, n: int) -> list[int]:
    """``n`` ids whose first three encode ``key``: no other key shares its first block."""
    ids = [_FILLER] * n  # one list, not the filler's and a concatenation: 22M ids a trace
    ids[:3] = _unique_head(key)[:n]
    return ids


def _placeholder_outputs(n: int, placeholder_ids: list[int]) -> list[int]:
    # What the simulator's executor will emit for this request (it cycles by position).
    return [placeholder_ids[i % len(placeholder_ids)] for i in range(n)]


def _server_ids(tokenizer: Any, endpoint: str, prompt: str | list[dict[str, str]]) -> list[int]:
    """The ids a server makes of what the client sent: chat messages through the model's
    template without added special tokens, a completion's text with them (as servelab's
    server and vLLM do)."""
    if endpoint == "chat":
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt, add_special_tokens=True)


def _after_answer(tokenizer: Any, endpoint: str, past: list[Any], prompt: str) -> list[int]:
    """The ids the client's text puts after the latest answer: the markup closing it and the
    new turn. Answers are stood in for by markers, since only their ids are known here."""
    if endpoint != "chat":
        return tokenizer.encode("\n\n" + prompt, add_special_tokens=False)
    marked = [(user, f"<<answer {i}>>") for i, (user, _) in enumerate(past)]
    text = tokenizer.apply_chat_template(
        compose_prompt(prompt, marked, endpoint), add_generation_prompt=True
    )
    last = marked[-1][1]
    if last not in text:
        raise ValueError(
            "the model's chat template leaves earlier answers out of the history, so the "
            "simulator cannot place the model's own replies in a later turn's prompt"
        )
    return tokenizer.encode(text[text.rindex(last) + len(last) :], add_special_tokens=False)


def requests_from_plan(
    plan: list[Any],
    tokenizer: Any,
    endpoint: str = "completions",
    placeholder_ids: list[int] | None = None,
    resend: Resend | None = None,
    draw_key: str = "",
) -> list[SimRequest]:
    """SimRequests for a ``bench.plan.Plan``: same ids, classes, times and lengths.

    Every prompt is what the client sends (``bench.workloads.request_plan.compose_prompt``), tokenized
    as the server does. Later turns of a session are sent ``think_time`` after the previous
    turn's last byte and, when the class says ``carry_history``, carry the conversation so
    far. A dataset's recorded replies are known text, so such a history is exact; the
    model's own replies are not, so the previous prompt's ids, the executor's output ids
    and the client's markup are joined. With ``resend`` (:mod:`servelab.sim.loop.history`) that
    resent answer differs from the generated tokens from a drawn position on, as a real
    client's retokenized text does (drawn per ``draw_key`` and request id).
    """
    ph = placeholder_ids or [1000]
    resend = resend or Resend()
    resent = min(set(range(1, len(ph) + 2)) - set(ph))  # an id the executor never emits
    out: list[SimRequest] = []
    last_turn: dict[str, tuple[SimRequest, list[int]]] = {}
    history: dict[str, list[tuple[str, str | None]]] = {}
    for p in plan:
        turn, session_id = p.tags.turn, p.tags.session_id
        after, think = None, 0.0
        past: list[tuple[str, str | None]] = []
        if turn > 0 and session_id in last_turn:
            prev, prev_ids = last_turn[session_id]
            after, think = prev.request_id, p.think_time
            past = history[session_id] if p.carry_history else []
        if any(reply is None for _, reply in past):
            answer = _placeholder_outputs(prev.max_tokens, ph)
            cut = resend.cut(f"{draw_key}:{p.request_id}")
            if cut < len(answer):
                answer[int(cut) :] = [resent] * (len(answer) - int(cut))
            ids = prev_ids + answer + _after_answer(tokenizer, endpoint, past, p.prompt)
        else:
            text = compose_prompt(p.prompt, cast(list[tuple[str, str]], past), endpoint)
            ids = _server_ids(tokenizer, endpoint, text)
        req = SimRequest(
            request_id=p.request_id,
            send_time=p.send_time or 0.0,
            prompt_token_ids=ids,
            max_tokens=p.max_tokens,
            tags=p.tags,
            after=after,
            think_time=think,
        )
        if session_id is not None:
            last_turn[session_id] = (req, ids)
            history.setdefault(session_id, []).append((p.prompt, p.reply))
        out.append(req)
    return out


def requests_from_trace(
    path: str,
    *,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    max_model_len: int | None = None,
    max_requests: int | None = None,
    max_duration: float | None = None,
    target_rate: float | None = None,
) -> tuple[list[SimRequest], dict[str, Any]]:
    """SimRequests replaying a trace file (Azure CSV or Mooncake JSONL); and the
    benchmark's report of how it was scaled and clipped."""
    from servelab.bench.workloads.traces import load_trace, scale_trace

    rows, fmt = load_trace(path)
    rows, report = scale_trace(
        rows,
        time_scale=time_scale,
        length_scale=length_scale,
        max_model_len=max_model_len,
        max_requests=max_requests,
        max_duration=max_duration,
        target_rate=target_rate,
    )
    out = []
    tags: dict[str | None, RequestTags] = {}  # one (frozen) per prefix group, not per row
    for i, row in enumerate(rows):
        if row.hash_ids:
            ids: list[int] = []
            b = row.block_tokens
            for j, h in enumerate(row.hash_ids):
                n = min(round((j + 1) * b), row.input_tokens) - len(ids)
                if n <= 0:
                    break
                ids += synthetic_ids(h, n)
            if len(ids) < row.input_tokens:  # the tail is the request's own
                ids += synthetic_ids(10**9 + i, row.input_tokens - len(ids))
            group = f"trace:{row.hash_ids[0]}"
        else:
            ids, group = synthetic_ids(i, row.input_tokens), None
        out.append(
            SimRequest(
                request_id=f"r{i:06d}",
                send_time=row.time,
                prompt_token_ids=ids,
                max_tokens=row.output_tokens,
                tags=tags.get(group)
                or tags.setdefault(group, RequestTags(workload_class="trace", prefix_group=group)),
            )
        )
    return out, {"trace": {"file": str(path), "format": fmt, **report}}
