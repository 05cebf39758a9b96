"""`servelab serve --speculative-config` over real HTTP on the tiny model: the same greedy text
as the engine without speculation, several tokens per streamed chunk, the spec timeline
and vLLM's spec_decode counters."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from server_helpers import serve_process

from servelab.engine.engine_config import EngineConfig
from servelab.engine.sampling_params import SamplingParams
from servelab.model.build import build_engine
from servelab.model.llm import LLM

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over"


def test_speculative_server_streams_accepted_tokens(tiny_llama_dir: Path, tmp_path: Path) -> None:
    engine = build_engine(str(tiny_llama_dir), EngineConfig(max_model_len=512), "cpu")
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    want = LLM.from_engine(engine).generate([PROMPT], sp)[0].text

    # The model as its own draft: every greedy draft is accepted, so chunks must carry several.
    spec = {"method": "draft", "num_speculative_tokens": 3, "model": str(tiny_llama_dir)}
    flags = ["--model", str(tiny_llama_dir), "--max-model-len", "512", "--threads", "1"]
    with serve_process(
        tmp_path / "serve.log", *flags, "--speculative-config", json.dumps(spec)
    ) as s:
        body = {
            "model": str(tiny_llama_dir),
            "prompt": PROMPT,
            "max_tokens": 32,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        texts, usage, rid = [], None, None
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                rid = chunk["id"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    texts.append(chunk["choices"][0]["text"])
                usage = chunk.get("usage") or usage
        assert "".join(texts) == want
        assert usage["completion_tokens"] == 32
        assert len(texts) <= 32 // 4 + 1  # 3 accepted drafts + 1 token per step and chunk

        tl = httpx.get(f"{s.url}/v1/timelines", params={"ids": rid.removeprefix("cmpl-")}).json()
        (timeline,) = tl["timelines"]
        accepted = sum(rec["accepted"] for rec in timeline["spec"])
        assert accepted == sum(rec["proposed"] for rec in timeline["spec"]) > 0
        assert len(timeline["token_times"]) == 32

        metrics = httpx.get(f"{s.url}/metrics").text
        found = re.search(
            r"^vllm:spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)$", metrics, re.MULTILINE
        )
        assert found and float(found.group(1)) == accepted
        assert "vllm:spec_decode_num_drafts_total" in metrics
