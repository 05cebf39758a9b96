"""One in-process engine, no server: `servelab generate` (``GenerateSpec``, ``run_generate``)
and the offline demo (``run_offline_demo``), a mixed batch and every request's phases.

Wave 1: three short chat prompts sharing a system prompt, and one long RAG-like prompt
(chunked by a small token budget while the chat requests decode). Wave 2, added once the
long prompt has its first token: two more chat prompts and a second question on the same
document, which hit the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from servelab.vocab import DEFAULT_MODEL

if TYPE_CHECKING:
    from rich.console import Console

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


def chat_ids(engine: LLMEngine, user: str, system: str | None = None) -> list[int]:
    tok = engine.tokenizer
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}
    ]
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))


@dataclass(frozen=True)
class GenerateSpec:
    """One `servelab generate`: ``prompt`` (wrapped in the chat template with ``chat``) on
    ``model`` with weights in ``quantization`` mode on ``device``, sampled greedily
    (``temperature`` 0) or with ``seed``, for at most ``max_tokens``."""

    prompt: str
    model: str = DEFAULT_MODEL
    max_tokens: int = 64
    temperature: float = 0.0
    seed: int | None = None
    chat: bool = True
    device: str | None = None
    quantization: str = "none"


def run_generate(spec: GenerateSpec, console: Console) -> None:
    """Stream the generated text to ``console``, then the request's phase timeline.
    Raises ValueError for a setting or model the engine refuses."""
    from servelab.engine.engine_config import EngineConfig
    from servelab.engine.sampling_params import SamplingParams
    from servelab.model.build import build_engine
    from servelab.report.terminal import phase_table
    from servelab.vocab import check_quantization

    check_quantization(spec.quantization)
    sp = SamplingParams(max_tokens=spec.max_tokens, temperature=spec.temperature, seed=spec.seed)
    engine = build_engine(
        spec.model, EngineConfig(), device=spec.device, quantization=spec.quantization
    )
    if spec.chat:
        ids = chat_ids(engine, spec.prompt)
        engine.add_request("generate-0", prompt_token_ids=ids, sampling_params=sp)
    else:
        engine.add_request("generate-0", prompt=spec.prompt, sampling_params=sp)
    while engine.has_unfinished():
        for out in engine.step().outputs:
            console.print(out.new_text, end="", highlight=False, markup=False)
    console.print()
    console.print(phase_table(engine.finished_timelines[-1]))


def run_offline_demo(
    model: str = DEFAULT_MODEL, device: str | None = None, max_num_batched_tokens: int = 256
) -> list[RequestTimeline]:
    """Generate for the mixed batch and print each request's phase timeline; return them."""
    from rich.console import Console

    from servelab.engine.engine_config import EngineConfig
    from servelab.engine.sampling_params import SamplingParams
    from servelab.model.build import build_engine
    from servelab.report.terminal import timeline_table

    console = Console(width=max(Console().width, 140))  # the table has many columns
    console.print(f"[bold]Loading {model}...[/bold]")
    config = EngineConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=16)
    engine = build_engine(model, config, device=device)
    chat = SamplingParams(max_tokens=32, temperature=0.0)
    rag = SamplingParams(max_tokens=24, temperature=0.0)

    def rag_ids(question: str, paragraphs: int = 12) -> list[int]:
        doc = "".join(_DOC_PARAGRAPH.format(i=i) for i in range(1, paragraphs + 1))
        ids = chat_ids(engine, f"Document:\n{doc}\n\nQuestion: {question}", _SYSTEM)
        # A small model's context may not hold the whole document: keep half of it free.
        if len(ids) > engine.config.max_model_len // 2 and paragraphs > 1:
            return rag_ids(question, paragraphs - 1)
        return ids

    for i, q in enumerate(_QUESTIONS[:3]):
        engine.add_request(
            f"chat-{i}", prompt_token_ids=chat_ids(engine, q, _SYSTEM), sampling_params=chat
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
                    ids = chat_ids(engine, q, _SYSTEM)
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
