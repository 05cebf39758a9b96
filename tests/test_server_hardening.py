"""Hostile input against the server: one regression test per failure found by probing it,
the auth matrix, stale metrics after engine death, slow clients, and a fuzz of oversized
requests. Same model-free engine as test_server_api.py (server_fakes.fake_engine)."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import ServerThread, metrics, newest_core_pid, serving

from servelab.modelcore.tokenizer import Tokenizer
from servelab.server.api import ServerState, build_app
from servelab.server.bounds import json_too_deep, least_tokens, longest_token_chars
from servelab.server.openai_protocol import MAX_JSON_DEPTH, MAX_MESSAGES

KEY = "hardening-key"
HEALTH_TIMEOUT_S = 10.0  # generous for a loaded machine: the point is that it answers at all


def error_of(r: httpx.Response) -> dict[str, Any]:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["code"]
    return err


def assert_healthy(http: httpx.Client) -> None:
    assert http.get("/health", timeout=HEALTH_TIMEOUT_S).status_code == 200


# ---- the bounds themselves ----


def test_json_depth_counts_brackets_outside_strings_only() -> None:
    assert not json_too_deep(b'{"a": [[1]]}', 3) and json_too_deep(b'{"a": [[1]]}', 2)
    assert not json_too_deep(json.dumps({"a": "[[[[[[" * 9, "b": [1]}).encode(), 2)
    # An escaped quote does not end a string, an escaped backslash before a quote does.
    assert not json_too_deep(json.dumps({"a": '\\"[[[[[[[\\', "b": [1]}).encode(), 2)
    assert json_too_deep(json.dumps({"a": "\\", "b": [[[1]]]}).encode(), 3)
    assert not json_too_deep(json.dumps({"a": "\\", "b": [[[1]]]}).encode(), 4)
    wide = json.dumps({"m": [{"c": [1]}] * 10_000}).encode()
    assert not json_too_deep(wide, 4) and json_too_deep(wide, 3)


def test_longest_token_bound_is_never_beaten(tiny_tok: Tokenizer) -> None:
    longest = longest_token_chars(tiny_tok)
    assert longest is not None and longest > 1
    for text in ("a" * 5000, "Hello world! " * 400, "ünïcødé 日本語 😀 " * 300, "#" * 999):
        assert len(tiny_tok.encode(text)) >= least_tokens(len(text), longest)


# ---- 1. out-of-range integers: 400 naming the field, never 500 ----


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("priority", 1208925819614629174706176),
        ("priority", -(2**63) - 1),
        ("seed", 2**64),
        ("max_tokens", 2**70),
        ("min_tokens", 2**64),
        ("top_k", -(2**80)),
        ("n", 2**64),
        ("stop_token_ids", [2**64]),
        ("prompt", [1, 2**64]),
        ("logit_bias", {"5": 10**400}),
        ("logit_bias", {"5": -100}),  # in range, but not supported: never silently ignored
    ],
)
def test_huge_integers_are_400_naming_the_field(http: httpx.Client, field: str, value: Any) -> None:
    body = {"prompt": "hi", "max_tokens": 4, field: value}
    r = http.post("/v1/completions", content=json.dumps(body))
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == field


def test_priority_in_int64_range_is_served(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": -(2**63)})
    assert r.status_code == 200, r.text


# ---- 2. deep nesting ----


@pytest.mark.parametrize("where", ["unknown", "prompt", "response_format"])
def test_deep_nesting_is_400(http: httpx.Client, where: str) -> None:
    deep = "[" * 2000 + "]" * 2000
    body = f'{{"prompt": "hi", "max_tokens": 2, "{where}": {deep}}}'
    r = http.post("/v1/completions", content=body)
    assert r.status_code == 400, r.text
    assert str(MAX_JSON_DEPTH) in error_of(r)["message"]
    ok = json.dumps({"prompt": "hi", "max_tokens": 2, "x": json.loads("[" * 20 + "]" * 20)})
    assert http.post("/v1/completions", content=ok).status_code == 200


def test_depth_hidden_by_brackets_in_strings_is_still_400(http: httpx.Client) -> None:
    # Valid JSON 3000 levels deep, but counted raw each level closes inside a string.
    masked = '["]", ' * 3000 + "1" + ', "["]' * 3000
    body = f'{{"prompt": "hi", "max_tokens": 2, "junk": {masked}}}'
    r = http.post("/v1/completions", content=body)
    assert r.status_code == 400, r.text
    assert_healthy(http)


# ---- 3 and 4. big bodies: refused before tokenising, off the event loop ----


def test_many_messages_are_400(http: httpx.Client) -> None:
    msgs = [{"role": "user", "content": "hi"}] * 300_000
    r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
    assert r.status_code == 400 and error_of(r)["param"] == "messages"
    assert str(MAX_MESSAGES) in error_of(r)["message"]


@pytest.mark.parametrize("chat", [False, True])
def test_a_text_that_cannot_fit_is_refused_untokenised(http: httpx.Client, chat: bool) -> None:
    text = "x" * 15_000_000
    if chat:
        r = http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]}
        )
    else:
        r = http.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["code"] == "context_length_exceeded" and "15000000 characters" in err["message"]
    assert err["param"] == ("messages" if chat else "prompt")


def test_health_answers_while_big_requests_are_processed(http: httpx.Client) -> None:
    bodies = [
        ("/v1/completions", {"prompt": "y" * 15_000_000, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 200_000}),
        # Big enough to be parsed off the loop, and valid: served.
        ("/v1/completions", {"prompt": "Hello world.", "max_tokens": 2, "junk": "j" * 100_000}),
    ]
    statuses: list[int] = []

    def send() -> None:
        with httpx.Client(base_url=http.base_url, timeout=120) as c:
            statuses.extend(c.post(path, json=body).status_code for path, body in bodies)

    sender = threading.Thread(target=send)
    sender.start()
    polls = []
    while sender.is_alive():
        polls.append(http.get("/health", timeout=HEALTH_TIMEOUT_S).status_code)
        time.sleep(0.02)
    sender.join()
    assert statuses == [400, 400, 200]
    assert polls and set(polls) == {200}


def test_memory_returns_after_a_burst_of_huge_prompts(http: httpx.Client) -> None:
    # The server runs in this process. Tokenising one 15 MB prompt would grow it by ~2 GB; the
    # character bound refuses it with only the body and its decoded string in memory.
    # Those bodies are prepared in worker processes, which trim their heap after each one.
    me = psutil.Process()
    workers = [p for p in me.children() if "spawn_main" in " ".join(p.cmdline())]
    assert len(workers) == 2

    def rss() -> list[int]:
        return [p.memory_info().rss for p in (me, *workers)]

    warm = {"prompt": "Hello world.", "max_tokens": 2, "junk": "j" * 100_000}  # first decodes
    for _ in range(4):
        assert http.post("/v1/completions", json=warm).status_code == 200
    base = rss()
    for _ in range(5):
        r = http.post("/v1/completions", json={"prompt": "z" * 15_000_000, "max_tokens": 2})
        assert r.status_code == 400
    assert rss()[0] - base[0] < 300 * 1024**2
    # A worker frees a body just after answering: allow it a moment.
    deadline = time.monotonic() + 5
    while not all(a < 1.2 * b for a, b in zip(rss()[1:], base[1:])):
        assert time.monotonic() < deadline, (base, rss())
        time.sleep(0.05)


def test_preparation_workers_yield_the_cpu_to_the_api_process(http: httpx.Client) -> None:
    # A worker chewing a 10 MB body must not keep the API's loop (and /health) off the CPU.
    me = psutil.Process()
    workers = [p for p in me.children() if "spawn_main" in " ".join(p.cmdline())]
    assert workers and all(w.nice() > me.nice() for w in workers)


def test_body_over_the_limit_is_413(http: httpx.Client) -> None:
    r = http.post("/v1/completions", content=b'{"prompt": "' + b"a" * (17 * 1024**2) + b'"}')
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"


# ---- 5. stop lists ----


@pytest.mark.parametrize(
    "stop",
    [["s"] * 1_000_000, ["a", "b", "c", "d", "e"], ["x" * 257]],
)
def test_stop_is_capped(http: httpx.Client, stop: list[str]) -> None:
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stop": stop})
    assert r.status_code == 400 and error_of(r)["param"] == "stop"


def test_four_stop_strings_and_many_stop_ids(http: httpx.Client) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "stop": ["a1", "b2", "c3", "d4"]}
    assert http.post("/v1/completions", json=body).status_code == 200
    r = http.post("/v1/completions", json={**body, "stop_token_ids": list(range(300))})
    assert r.status_code == 400 and error_of(r)["param"] == "stop_token_ids"
    # Duplicates count once.
    assert (
        http.post("/v1/completions", json={**body, "stop_token_ids": [5] * 10_000}).status_code
        == 200
    )


def test_max_stop_sequences_flag_raises_the_cap(tiny_llama_dir: Path) -> None:
    with serving(tiny_llama_dir, max_stop_sequences=8) as srv, httpx.Client(base_url=srv.url) as c:
        body = {"prompt": "hi", "max_tokens": 2}
        assert c.post("/v1/completions", json={**body, "stop": list("abcdefgh")}).status_code == 200
        assert (
            c.post("/v1/completions", json={**body, "stop": list("abcdefghi")}).status_code == 400
        )


# ---- 7. error shapes of aiohttp's own parser ----


def raw_http(url: str, data: bytes, timeout: float = 10.0) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\n"
        + b"".join(b"X-%d: 1\r\n" % i for i in range(200))
        + b"\r\n",
        b"G@T /health HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz\r\nhello\r\n0\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,  # TLS to an HTTP port
    ],
)
def test_parser_errors_are_openai_json(server: ServerThread, request_bytes: bytes) -> None:
    head, _, body = raw_http(server.url, request_bytes).partition(b"\r\n\r\n")
    assert head.split(b" ")[1].startswith(b"4"), head
    assert b"application/json" in head.lower()
    err = json.loads(body)["error"]
    assert err["code"] and err["type"] == "invalid_request_error" and err["message"]


def test_route_errors_have_codes(http: httpx.Client) -> None:
    assert error_of(http.get("/v1/nope"))["code"] == "not_found"
    assert error_of(http.get("/v1/completions"))["code"] == "method_not_allowed"
    bad = http.post("/v1/completions", json={"prompt": "hi", "temperature": -1})
    assert error_of(bad)["code"] == "invalid_request"


# ---- auth matrix, /version, header timeout (one keyed server) ----


@pytest.fixture(scope="module")
def keyed(tiny_llama_dir: Path) -> Iterator[ServerThread]:
    with serving(
        tiny_llama_dir, api_key=KEY, header_timeout=0.5, keep_alive_timeout=3.0, body_timeout=1.0
    ) as srv:
        yield srv


ENDPOINTS = [
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}, True),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, True),
    ("GET", "/v1/models", None, True),
    ("GET", "/v1/timelines", None, True),
    ("POST", "/reset_prefix_cache", None, True),
    ("GET", "/health", None, False),
    ("GET", "/metrics", None, False),
    ("GET", "/version", None, False),
]


@pytest.mark.parametrize(("method", "path", "body", "needs_key"), ENDPOINTS)
def test_auth_matrix(
    keyed: ServerThread, method: str, path: str, body: Any, needs_key: bool
) -> None:
    with httpx.Client(base_url=keyed.url, timeout=60) as c:
        if body is not None and "messages" in body:
            body = {**body, "max_tokens": 2}
        for header in ({}, {"Authorization": "Bearer wrong"}):
            r = c.request(method, path, json=body, headers=header)
            if needs_key:
                assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
                assert KEY not in r.text
            else:
                assert r.status_code == 200
        r = c.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text


def test_every_route_is_in_the_auth_matrix() -> None:
    app = build_app(ServerState(None, None, None, None))  # type: ignore[arg-type]
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    assert routes == {(m, p) for m, p, _, _ in ENDPOINTS}


def test_version_shows_no_pid(keyed: ServerThread) -> None:
    version = httpx.get(f"{keyed.url}/version").json()
    assert "pid" not in version["engine"] and version["engine"]["max_model_len"] == 512


def slow_client_closed_after(url: str, first: bytes, trickle: bytes = b"") -> float:
    """Send ``first``, then ``trickle`` every 0.1 s (if given); seconds until the server
    closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        done = threading.Event()

        def drip() -> None:
            with contextlib.suppress(OSError):
                while trickle and not done.wait(0.1):
                    s.sendall(trickle)

        t0 = time.monotonic()
        s.sendall(first)
        sender = threading.Thread(target=drip)
        sender.start()
        try:
            while s.recv(65536):
                pass
        finally:
            done.set()
            sender.join()
        return time.monotonic() - t0


def test_header_timeout_closes_slow_and_idle_connections(keyed: ServerThread) -> None:
    # A slowloris sends part of a request head and stalls, or trickles it a byte at a time;
    # a client that connects sends nothing. Each is closed at --header-timeout (0.5 s),
    # well before --keep-alive-timeout (3 s).
    assert slow_client_closed_after(keyed.url, b"GET /health HTTP/1.1\r\nHost: x\r\nX-a:") < 2.5
    assert slow_client_closed_after(keyed.url, b"") < 2.5
    assert slow_client_closed_after(keyed.url, b"GET /health HTTP/1.1\r\n", trickle=b"X") < 2.5
    # A complete request on time is answered, and the connection stays open for the next.
    with httpx.Client(base_url=keyed.url) as c:
        assert c.get("/health").status_code == 200 and c.get("/health").status_code == 200


def _get_health(s: socket.socket) -> bytes:
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    reply = b""
    while b"\r\n\r\n" not in reply:
        chunk = s.recv(65536)
        assert chunk, f"closed after {reply!r}"
        reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        body += s.recv(65536)
    return head


def test_an_idle_connection_outlives_the_header_timeout_until_keep_alive(
    keyed: ServerThread,
) -> None:
    # An idle connection is the client pool's to drop: closing it at the header timeout made
    # a client that reused it just then lose its request (a reset, not retried for a POST).
    host, port = keyed.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        assert _get_health(s).startswith(b"HTTP/1.1 200")
        time.sleep(1.5)  # 3x --header-timeout, idle
        assert _get_health(s).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        while s.recv(65536):
            pass
        assert time.monotonic() - t0 > 1.5  # closed by --keep-alive-timeout (3 s), not 0.5 s


def test_body_bytes_never_start_the_header_timer(keyed: ServerThread) -> None:
    # Body bytes that came after their head while no handler ran were taken for a new
    # head's first byte: --header-timeout later the connection was closed, which cut a
    # stream whose body came a loop iteration after its head (a GuideLLM stream ended
    # after 7 tokens). A body sent after the answer (/health does not read it) reaches
    # the same state every time; the connection must then live on as an idle one.
    host, port = keyed.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = s.recv(65536)
            assert chunk, f"closed after {reply!r}"
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200")
        s.sendall(b"hello")
        time.sleep(1.5)  # 3x --header-timeout
        assert _get_health(s).startswith(b"HTTP/1.1 200")


def test_body_timeout_answers_408_and_closes_a_trickling_body(keyed: ServerThread) -> None:
    # Headers in time, then a body of 1000 bytes at 5 bytes/s: it would take 200 s.
    host, port = keyed.url.removeprefix("http://").split(":")
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: 1000\r\n\r\n"
    ).encode()
    done = threading.Event()
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(head + b'{"prompt": "')

        def trickle() -> None:
            with contextlib.suppress(OSError):
                while not done.wait(0.2):
                    s.sendall(b"a")

        sender = threading.Thread(target=trickle)
        sender.start()
        t0 = time.monotonic()
        reply = b""
        try:
            while chunk := s.recv(65536):
                reply += chunk
        finally:
            done.set()
            sender.join()
        closed_after = time.monotonic() - t0
    status, _, rest = reply.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 408"), reply[:200]
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    assert b"Connection: close" in rest
    # Answered at --body-timeout (1 s) and closed after the server's lingering read
    # (LINGER_S), while the client still trickles: aiohttp's own 10 s would take longer.
    assert closed_after < 1.0 + 10.0


# ---- 6 and 7. engine death: stale metrics, engine_dead everywhere ----


def test_engine_death_metrics_and_errors(tiny_llama_dir: Path) -> None:
    with serving(tiny_llama_dir) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        body = {"prompt": "Hello", "max_tokens": 450, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            live = metrics(http)
            assert live["servelab:engine_alive"] == 1 and live["vllm:num_requests_running"] == 1
            assert live["servelab:kv_cache_blocks_used"] > 0
            psutil.Process(newest_core_pid()).send_signal(signal.SIGKILL)
            rest = [line for line in lines if line]
        assert json.loads(rest[-2][6:])["error"]["code"] == "engine_dead"
        dead = metrics(http)
        assert dead["servelab:engine_alive"] == 0
        for gauge in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "servelab:kv_cache_blocks_used",
        ):
            assert dead[gauge] == 0, gauge
        assert error_of(http.get("/health"))["code"] == "engine_dead"
        for path, req in (
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/reset_prefix_cache", None),
        ):
            r = http.post(path, json=req)
            assert r.status_code == 503 and error_of(r)["code"] == "engine_dead", path


# ---- fuzz: oversized and malformed requests ----


class RawJSON(str):
    """A field value that is already JSON text."""


def body_text(fields: dict[str, Any]) -> str:
    return (
        "{"
        + ", ".join(
            f"{json.dumps(k)}: {v if isinstance(v, RawJSON) else json.dumps(v)}"
            for k, v in fields.items()
        )
        + "}"
    )


HUGE_INT = st.integers(min_value=2**63, max_value=2**200) | st.integers(
    min_value=-(2**200), max_value=-(2**63) - 1
)
INT_FIELDS = ["max_tokens", "min_tokens", "top_k", "seed", "n", "priority", "best_of"]


def deep(depth: int) -> str:
    """JSON text nested ``depth`` deep (as text: Python objects that deep break repr)."""
    return "[" * depth + "1" + "]" * depth


CASES = st.one_of(
    st.builds(lambda f, v: {f: v}, st.sampled_from(INT_FIELDS), HUGE_INT),
    st.builds(lambda v: {"stop_token_ids": [v]}, HUGE_INT),
    st.builds(lambda v: {"prompt": [1, v]}, HUGE_INT),
    st.builds(
        lambda f, d: {f: RawJSON(deep(d))},
        st.sampled_from(["prompt", "response_format", "tools", "junk", "stop"]),
        st.integers(MAX_JSON_DEPTH - 2, 3000),
    ),
    st.builds(
        lambda n, c: {"prompt": c * n}, st.integers(10_000, 3_000_000), st.sampled_from("a #é")
    ),
    st.builds(lambda n: {"stop": ["s"] * n}, st.integers(0, 200_000)),
    st.builds(lambda n: {"stop": ["x" * n]}, st.integers(1, 100_000)),
    st.builds(
        lambda n, c: {"messages": [{"role": "user", "content": c}] * n},
        st.integers(1, 20_000),
        st.sampled_from(["", "hi", "x" * 2000]),
    ),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=CASES, chat=st.booleans())
def test_fuzzed_oversized_requests_never_5xx(
    http: httpx.Client, case: dict[str, Any], chat: bool
) -> None:
    base: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        if chat
        else {"prompt": "hi", "max_tokens": 2}
    )
    r = http.post(
        "/v1/chat/completions" if chat else "/v1/completions",
        content=body_text({**base, **case}),
    )
    assert r.status_code < 500, r.text[:500]
    if r.status_code >= 400:
        error_of(r)
    assert_healthy(http)


def test_big_bodies_hand_freed_memory_back_and_small_ones_do_not(
    http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # glibc keeps the heap big bodies grew; the server trims it after them (at most once per
    # body, once for a burst that ends within the trim's delay), never after small ones.
    from servelab.server import api

    calls: list[int] = []
    monkeypatch.setattr(api, "MALLOC_TRIM", calls.append)
    big = json.dumps({"prompt": "word " * 400_000, "max_tokens": 2}).encode()
    for _ in range(3):
        assert http.post("/v1/completions", content=big).status_code == 400
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(2 * api._TRIM_DELAY_S)
    assert 1 <= len(calls) <= 3 and set(calls) == {0}
    before = len(calls)
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    time.sleep(2 * api._TRIM_DELAY_S)
    assert len(calls) == before
