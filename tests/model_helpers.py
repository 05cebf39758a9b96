"""Shared pieces of the model and engine tests on real (tiny) models: texts to tokenize,
prompts, and an engine on a loaded model with the CPU runner."""

from __future__ import annotations

from servelab.engine.engine import LLMEngine
from servelab.engine.engine_config import EngineConfig
from servelab.engine.sampling_params import SamplingParams
from servelab.model.llm import LLM
from servelab.model.loader import LoadedModel
from servelab.model.torch_runner import TorchModelRunner

# Round-trip texts for tokenizers: whitespace runs, digits, non-Latin scripts, emoji,
# special tokens, contractions and code.
ROUND_TRIP_TEXTS = [
    "Hello world!",
    "  leading spaces,\ttabs and\n\nblank lines  ",
    "numbers 1234567 and 3.14159",
    "ünïcødé, 日本語のテキスト, emoji 😀👍🏽",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "don't you'll I'M they've",
    "def f(x):\n    return x ** 2  # code",
]

PROMPT_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefill computes the prompt; decode produces one token per step.",
    "A paged KV cache stores keys and values in fixed-size blocks. " * 3,
    "Hello world!",
    "Continuous batching mixes prefill chunks with decode steps of other requests. " * 2,
    "Numbers like 12345 and 3.14159 are split into digits.",
]
TINY_SP = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def make_engine(loaded: LoadedModel, **cfg) -> LLMEngine:
    cfg.setdefault("block_size", 4)
    cfg.setdefault("num_kv_blocks", 512)
    # One thread: tests run beside other work, and oversubscribed threads spin for seconds.
    runner = TorchModelRunner(loaded, device="cpu", num_threads=1, seed=0)
    return LLMEngine(runner, EngineConfig(**cfg), tokenizer=loaded.tokenizer)


def generate(engine: LLMEngine, prompts: list[list[int]], sp: SamplingParams) -> list[list[int]]:
    return [r.token_ids for r in LLM.from_engine(engine).generate(prompts, sp)]


def alone(loaded: LoadedModel, prompts: list[list[int]], sp: SamplingParams) -> list[list[int]]:
    return [generate(make_engine(loaded), [p], sp)[0] for p in prompts]
