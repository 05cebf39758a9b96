"""`servelab generate` and the offline demo, on the tiny random Llama."""

from __future__ import annotations

from pathlib import Path

import typer
from typer.testing import CliRunner

from servelab.cli import app
from servelab.workflows.offline import run_offline_demo


def test_generate_prints_text_and_timeline(tiny_llama_dir: Path) -> None:
    args = ["generate", "--model", str(tiny_llama_dir), "--prompt", "Hello world!"]
    res = CliRunner().invoke(app, [*args, "--max-tokens", "5", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    for phase in ("queued", "admitted", "prefill chunk", "first token", "decode", "finished"):
        assert phase in res.output


def test_generate_bad_input_says_what_to_do(tiny_llama_dir: Path) -> None:
    res = CliRunner().invoke(app, ["generate", "--model", "no-such-model", "--prompt", "hi"])
    assert res.exit_code != 0 and "smollm2-135m" in res.output
    args = ["generate", "--model", str(tiny_llama_dir), "--prompt", "hi", "--max-tokens", "0"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code != 0 and "max_tokens must be at least 1" in res.output


def test_offline_demo_shows_chunks_and_prefix_hits(tiny_llama_dir: Path) -> None:
    timelines = {t.request_id: t for t in run_offline_demo(str(tiny_llama_dir), "cpu", 64)}
    assert set(timelines) == {f"chat-{i}" for i in range(5)} | {"rag-0", "rag-1"}
    assert len(timelines["rag-0"].chunks) > 1  # the long prompt was chunked
    assert timelines["rag-1"].cached_tokens > timelines["rag-0"].cached_tokens  # same document
    assert all(timelines[f"chat-{i}"].cached_tokens > 0 for i in (3, 4))  # shared system prompt
    assert all(t.finish_reason is not None for t in timelines.values())


def test_every_command_is_registered_the_same_way() -> None:
    from servelab.cli import (
        analyze,
        bench,
        export_hf,
        generate,
        imports,
        runexport,
        serve,
        sim,
        sim_inputs,
        tune,
    )

    modules = (
        analyze,
        bench,
        export_hf,
        generate,
        serve,
        sim,
        sim_inputs,
        tune,
        runexport,
        imports,
    )
    listed = {name for m in modules for name in m.COMMANDS}
    assert set(typer.main.get_command(app).commands) == listed | {"version"}
