"""CLI commands of the engine: `servelab generate` and `servelab offline-demo`.

No heavy imports at module level (the engine and torch load inside the commands).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from rich.table import Table

    from servelab.engine.engine import LLMEngine
    from servelab.vocab import RequestTimeline

# The offline demo's workload: chat turns sharing a system prompt, and one long RAG-like prompt.
_SYSTEM = (
    "You are a concise assistant for a team that runs language models in production. "
    "Answer in one or two sentences."
)
_QUESTIONS = [
    "What is the prefill phase of LLM inference?",
    "Why does decoding produce one token per step?",
    "What does a KV cache store?",
    "Name one way to reduce time to first token.",
    "What is continuous batching?",
]
_DOC_PARAGRAPH = (
    "Section {i}. The serving system keeps the keys and values of every processed token in a "
    "paged cache of fixed-size blocks. A request first runs its prompt through the model in one "
    "or more prefill chunks, which fills the cache and yields the first output token; then it "
    "decodes, one token per step, sharing each step with other requests. Long prompts are split "
    "into chunks so that running decodes are not stalled, and prompts that share a prefix reuse "
    "its cached blocks instead of computing them again. "
)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:,.0f}"


def timeline_table(timelines: list[RequestTimeline], title: str = "Request timelines") -> Table:
    """One row per request: queue, prefill chunks, cached tokens, TTFT, decode, tokens/s."""
    from rich.table import Table

    table = Table(title=f"{title} (times in ms)")
    table.add_column("request")
    for col in ("prompt", "cached", "queue", "chunks", "prefill", "TTFT", "out", "decode"):
        table.add_column(col, justify="right")
    for col in ("tok/s", "preempt", "finish"):
        table.add_column(col, justify="right")
    for t in timelines:
        ttft = None if t.first_token is None else t.first_token - t.arrival
        rate = (t.output_tokens - 1) / t.decode_time if t.decode_time > 0 else None
        chunks = "+".join(str(c.tokens) for c in t.chunks) or "-"
        table.add_row(
            t.request_id,
            str(t.prompt_tokens),
            str(t.cached_tokens),
            _ms(t.queue_time),
            chunks,
            _ms(t.prefill_time),
            _ms(ttft),
            str(t.output_tokens),
            _ms(t.decode_time),
            "-" if rate is None else f"{rate:.1f}",
            str(len(t.preemptions)),
            t.finish_reason.value if t.finish_reason else "-",
        )
    return table


def phase_table(t: RequestTimeline) -> Table:
    """One request's phases in order: queue, prefill chunks, first token, decode, finish."""
    from rich.table import Table

    table = Table(title=f"Timeline of {t.request_id} (ms from arrival)")
    table.add_column("phase")
    for col in ("at", "took", "tokens"):
        table.add_column(col, justify="right")
    table.add_column("detail")

    def rel(x: float) -> str:
        return _ms(x - t.arrival)

    events: list[tuple[float, tuple[str, str, str, str, str]]] = []
    for x in t.queued:
        events.append((x, ("queued", rel(x), "", "", "")))
    for x in t.scheduled:
        events.append((x, ("admitted", rel(x), "", "", "")))
    for x in t.preemptions:
        events.append((x, ("preempted", rel(x), "", "", "back to the queue; recomputed later")))
    for c in t.chunks:
        detail = f"step {c.step_id}" + (f", {c.cached_tokens} cached" if c.cached_tokens else "")
        row = ("prefill chunk", rel(c.start), _ms(c.end - c.start), str(c.tokens), detail)
        events.append((c.start, row))
    if t.first_token is not None:
        events.append((t.first_token, ("first token", rel(t.first_token), "", "1", "TTFT")))
        if t.finished is not None and t.output_tokens > 1:
            rate = (t.output_tokens - 1) / t.decode_time if t.decode_time > 0 else 0.0
            row = ("decode", rel(t.first_token), _ms(t.decode_time), str(t.output_tokens - 1))
            events.append((t.first_token, (*row, f"{rate:.1f} tok/s")))
    if t.finished is not None:
        reason = t.finish_reason.value if t.finish_reason else ""
        events.append((t.finished, ("finished", rel(t.finished), "", "", reason)))
    for _, row in sorted(events, key=lambda e: e[0]):  # stable: same-time rows keep order
        table.add_row(*row)
    return table


def _chat_ids(engine: LLMEngine, user: str, system: str | None = None) -> list[int]:
    tok = engine.tokenizer
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}
    ]
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))


def run_offline_demo(
    model: str = "smollm2-135m", device: str | None = None, max_num_batched_tokens: int = 256
) -> list[RequestTimeline]:
    """Generate for a mixed batch and print each request's phase timeline; return them.

    Wave 1: three short chat prompts sharing a system prompt, and one long RAG-like prompt
    (chunked by the small token budget while the chat requests decode). Wave 2, added once
    the long prompt has its first token: two more chat prompts and a second question on the
    same document, which hit the prefix cache.
    """
    from rich.console import Console

    from servelab.engine.config import EngineConfig
    from servelab.engine.engine import LLMEngine
    from servelab.engine.sampling_params import SamplingParams

    console = Console(width=max(Console().width, 140))  # the table has many columns
    console.print(f"[bold]Loading {model}...[/bold]")
    config = EngineConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=16)
    engine = LLMEngine.from_model(model, config, device=device)
    chat = SamplingParams(max_tokens=32, temperature=0.0)
    rag = SamplingParams(max_tokens=24, temperature=0.0)

    def rag_ids(question: str, paragraphs: int = 12) -> list[int]:
        doc = "".join(_DOC_PARAGRAPH.format(i=i) for i in range(1, paragraphs + 1))
        ids = _chat_ids(engine, f"Document:\n{doc}\n\nQuestion: {question}", _SYSTEM)
        # A small model's context may not hold the whole document: keep half of it free.
        if len(ids) > engine.config.max_model_len // 2 and paragraphs > 1:
            return rag_ids(question, paragraphs - 1)
        return ids

    for i, q in enumerate(_QUESTIONS[:3]):
        engine.add_request(
            f"chat-{i}", prompt_token_ids=_chat_ids(engine, q, _SYSTEM), sampling_params=chat
        )
    engine.add_request(
        "rag-0", prompt_token_ids=rag_ids("What is stored in the cache?"), sampling_params=rag
    )
    wave2_added = False
    steps = 0
    with console.status("generating...") as status:
        while engine.has_unfinished():
            engine.step()
            steps += 1
            status.update(
                f"step {steps}: {engine.num_running} running, {engine.num_waiting} waiting"
            )
            rag0 = engine.get_timeline("rag-0")
            if not wave2_added and rag0 is not None and rag0.first_token is not None:
                for i, q in enumerate(_QUESTIONS[3:], start=3):
                    ids = _chat_ids(engine, q, _SYSTEM)
                    engine.add_request(f"chat-{i}", prompt_token_ids=ids, sampling_params=chat)
                ids = rag_ids("Why are long prompts split into chunks?")
                engine.add_request("rag-1", prompt_token_ids=ids, sampling_params=rag)
                wave2_added = True
    timelines = sorted(engine.finished_timelines, key=lambda t: t.arrival)
    console.print(
        timeline_table(
            timelines, f"{model}: {steps} steps, budget {max_num_batched_tokens} tokens/step"
        )
    )
    s = engine.stats()
    console.print(
        f"prefix cache: {s.prefix_cache_hits}/{s.prefix_cache_queries} tokens hit; "
        f"preemptions: {s.num_preemptions}; KV blocks: {s.kv_blocks_total}"
    )
    return timelines


def register(app: typer.Typer) -> None:
    """Add the engine's commands to the `servelab` app."""

    @app.command()
    def generate(
        prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt text."),
        model: str = typer.Option(
            "smollm2-135m", "--model", "-m", help="Short name, .gguf or HF dir."
        ),
        max_tokens: int = typer.Option(64, "--max-tokens", help="Most tokens to generate."),
        temperature: float = typer.Option(0.0, "--temperature", help="0 means greedy."),
        seed: int | None = typer.Option(None, "--seed", help="Seed for sampling."),
        chat: bool = typer.Option(
            True, "--chat/--raw", help="Wrap the prompt in the chat template."
        ),
        device: str | None = typer.Option(None, "--device", help="cpu, cuda, ... (default: best)."),
    ) -> None:
        """Generate text for one prompt and show its phase timeline."""
        from rich.console import Console

        from servelab.engine.config import EngineConfig
        from servelab.engine.engine import LLMEngine
        from servelab.engine.sampling_params import SamplingParams

        console = Console()
        try:
            sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
            engine = LLMEngine.from_model(model, EngineConfig(), device=device)
            if chat:
                engine.add_request(
                    "generate-0", prompt_token_ids=_chat_ids(engine, prompt), sampling_params=sp
                )
            else:
                engine.add_request("generate-0", prompt=prompt, sampling_params=sp)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from e
        while engine.has_unfinished():
            for out in engine.step().outputs:
                console.print(out.new_text, end="", highlight=False, markup=False)
        console.print()
        console.print(phase_table(engine.finished_timelines[-1]))

    @app.command("offline-demo")
    def offline_demo(
        model: str = typer.Option(
            "smollm2-135m", "--model", "-m", help="Short name, .gguf or HF dir."
        ),
        device: str | None = typer.Option(None, "--device", help="cpu, cuda, ... (default: best)."),
        max_num_batched_tokens: int = typer.Option(
            256, "--max-num-batched-tokens", help="Token budget per step."
        ),
    ) -> None:
        """Run a mixed offline batch (chat + a long RAG prompt) and show every request's phases."""
        run_offline_demo(model, device, max_num_batched_tokens)
