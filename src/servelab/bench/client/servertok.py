"""Prompt lengths from the server's own tokenizer, over HTTP, where there is no local one.

vLLM and SGLang answer ``POST /tokenize {"model", "prompt", "add_special_tokens"}`` with
``{"tokens": [...], "count"}``; llama.cpp's server answers ``POST /tokenize {"content",
"add_special"}`` with ``{"tokens": [...]}``. ``/detokenize`` (``{"tokens"}`` -> vLLM's
``{"prompt"}`` or llama.cpp's ``{"content"}``) inverts them where a prompt is cut from
dataset text.

Contract: ``ServerTokenizer.probe(url, model, api_key)`` returns a tokenizer when the server
tokenizes a test text in one of the two dialects, else None. It has the benchmark's
tokenizer interface (``encode``, ``encode_batch``, ``decode``) and no chat template, so
``--endpoint chat`` still needs a local ``--tokenizer``. Calls are blocking (the plan is built
before a stage sends anything), cached per text, and ``encode_batch`` runs ``THREADS`` at once.
It is not used for the client's re-count during a run, which would load the server under test.
"""

from __future__ import annotations

import http.client
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

SERVER_TOKENIZER = "server"  # `--tokenizer server`: always the server's /tokenize
THREADS = 8
TIMEOUT_S = 30.0
_PROBE_TEXT = " The quick brown fox jumps over the lazy dog."


class ServerTokenizerError(RuntimeError):
    """The server stopped tokenizing mid-plan (an error status or a body without tokens)."""


class ServerTokenizer:
    """The served model's tokenizer, asked over HTTP (module contract)."""

    eos_token_ids: list[int] = []

    def __init__(
        self, url: str, model: str, api_key: str | None = None, dialect: str = "vllm"
    ) -> None:
        u = urlsplit(url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.https = u.scheme == "https"
        self.prefix = u.path.rstrip("/")
        self.model = model
        self.dialect = dialect  # "vllm" (vLLM, SGLang) or "llamacpp"
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.name = f"{model} via {url.rstrip('/')}/tokenize"
        self._cache: dict[str, list[int]] = {}
        self._local = threading.local()

    # ------------------------------------------------------------------ HTTP

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            conn = self._local.conn = cls(self.host, self.port, timeout=TIMEOUT_S)
        return conn

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode()
        for attempt in (0, 1):  # a kept-alive connection the server closed: once more, fresh
            conn = self._conn()
            try:
                conn.request("POST", self.prefix + path, data, self.headers)
                resp = conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                self._local.conn = None
                if attempt:
                    raise
                continue
            if resp.status != 200:
                raise ServerTokenizerError(f"POST {path}: HTTP {resp.status}: {raw[:200]!r}")
            out = json.loads(raw)
            if not isinstance(out, dict):
                raise ServerTokenizerError(f"POST {path}: expected a JSON object")
            return out
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ interface

    @classmethod
    def probe(cls, url: str, model: str, api_key: str | None = None) -> ServerTokenizer | None:
        """A tokenizer for the server at ``url`` if it tokenizes, in either dialect."""
        for dialect in ("vllm", "llamacpp"):
            tok = cls(url, model, api_key, dialect)
            try:
                if tok.encode(_PROBE_TEXT):
                    return tok
            except (OSError, http.client.HTTPException, ValueError, ServerTokenizerError):
                continue
        return None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not add_special_tokens and text in self._cache:
            return self._cache[text]
        if self.dialect == "llamacpp":
            body: dict[str, Any] = {"content": text, "add_special": add_special_tokens}
        else:
            body = {"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens}
        tokens = self._post("/tokenize", body).get("tokens")
        if not isinstance(tokens, list):
            raise ServerTokenizerError("POST /tokenize: the answer has no 'tokens' list")
        ids = [t if isinstance(t, int) else t.get("id") for t in tokens]
        if not add_special_tokens:
            self._cache[text] = ids
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        with ThreadPoolExecutor(THREADS) as pool:
            return list(pool.map(self.encode, texts))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        body: dict[str, Any] = {"tokens": list(ids)}
        if self.dialect != "llamacpp":
            body["model"] = self.model
        out = self._post("/detokenize", body)
        text = out.get("prompt", out.get("content"))
        if not isinstance(text, str):
            raise ServerTokenizerError("POST /detokenize: the answer has no text")
        return text
