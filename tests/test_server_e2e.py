"""`servelab serve` as a user runs it: a child process with real weights, over real HTTP.

Most tests use the tiny random Llama (fast); the ``slow`` ones load SmolLM2-135M.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import ServeProcess, serve_process, storm_leaves_no_trace

from servelab.modelcore.tokenizer import Tokenizer

API_KEY = "e2e-key-do-not-log"


@pytest.fixture(scope="module")
def tiny_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeProcess]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    flags = [
        "--model",
        str(tiny_llama_dir),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "512",
    ]
    with serve_process(log, *flags, "--api-key", API_KEY) as server:
        yield server


@pytest.fixture(scope="module")
def tiny_openai(tiny_server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key=API_KEY, max_retries=0)


def test_openai_completions_stream_and_not(tiny_openai: openai.OpenAI, tiny_tok: Tokenizer) -> None:
    prompt = "Continuous batching mixes prefill chunks"
    n_prompt = len(tiny_tok.encode(prompt, add_special_tokens=True))
    extra = {"ignore_eos": True}
    full = tiny_openai.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, extra_body=extra
    )
    assert full.usage is not None
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (n_prompt, 6)
    assert full.choices[0].finish_reason == "length"
    chunks = list(
        tiny_openai.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (n_prompt, 6)
    assert "".join(c.choices[0].text for c in chunks[:-1]) == full.choices[0].text


def test_openai_chat_stream_and_not(tiny_openai: openai.OpenAI, tiny_tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello world!"},
    ]
    n_prompt = len(tiny_tok.encode(tiny_tok.apply_chat_template(messages)))
    full = tiny_openai.chat.completions.create(
        model="tiny",
        messages=messages,
        max_completion_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert full.usage is not None
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (n_prompt, 7)
    assert full.choices[0].message.role == "assistant"
    stream = tiny_openai.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=7,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7


def test_openai_errors(tiny_server: ServeProcess, tiny_openai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        tiny_openai.completions.create(model="other", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="512"):
        tiny_openai.completions.create(model="tiny", prompt="Hi", max_tokens=1000)
    anonymous = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()


def test_storm_on_the_tiny_model(tiny_server: ServeProcess) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=tiny_server.url, headers=headers, timeout=120) as http:
        storm_leaves_no_trace(http, n=200, max_tokens=6)


def test_api_key_never_logged(tiny_server: ServeProcess) -> None:
    text = tiny_server.log_text()
    assert "ready on http://127.0.0.1:" in text
    assert API_KEY not in text


def test_sigterm_lets_a_stream_finish(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with serve_process(tmp_path / "serve.log", "--model", str(tiny_llama_dir)) as server:
        body = {"prompt": "Hello", "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            server.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert server.proc.wait(60) == 0
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert "servelab serve: stopped" in server.log_text()


def test_bad_flags_fail_fast_with_a_message() -> None:
    for flags, needle in (
        (["--port", "70000"], "--port"),
        (["--model", "/no/such/model"], "unknown model"),
        (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "servelab.cli", "serve", *flags],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert r.returncode == 2 and needle in r.stderr, (flags, r.stderr)


@pytest.mark.slow
def test_smollm2_answers_over_http(smollm2_path: Path, tmp_path: Path) -> None:
    """The default model, greedy, through the chat template: a factual answer, streamed or not."""
    with serve_process(tmp_path / "serve.log", "--max-model-len", "1024", startup_s=600) as server:
        client = openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600
        )
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        full = client.chat.completions.create(
            model="smollm2-135m", messages=messages, max_tokens=12, temperature=0
        )
        answer = full.choices[0].message.content or ""
        assert "Paris" in answer
        tok = Tokenizer.from_model("smollm2-135m")
        assert full.usage is not None
        assert full.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(messages)))
        streamed = client.chat.completions.create(
            model="smollm2-135m", messages=messages, max_tokens=12, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == answer
