"""`servelab generate` and `servelab offline-demo`: one in-process engine, no server.

Parse -> spec -> call into ``workflows.offline``; no heavy imports at module level (the
engine and torch load inside the commands).
"""

from __future__ import annotations

from dataclasses import dataclass

import typer

from servelab.cli.extras import require_engine
from servelab.cli.field_options import command_from_fields, flag, spec_from_flags
from servelab.vocab import DEFAULT_MODEL


@dataclass(frozen=True)
class GenerateFlags:
    prompt: str = flag(..., "The prompt text.", decls=("--prompt", "-p"))
    model: str = flag(DEFAULT_MODEL, "Short name, .gguf or HF dir.", decls=("--model", "-m"))
    max_tokens: int = flag(64, "Most tokens to generate.", decls=("--max-tokens",))
    temperature: float = flag(0.0, "0 means greedy.", decls=("--temperature",))
    seed: int | None = flag(None, "Seed for sampling.", decls=("--seed",))
    chat: bool = flag(True, "Wrap the prompt in the chat template.", decls=("--chat/--raw",))
    device: str | None = flag(None, "cpu, cuda, ... (default: best).", decls=("--device",))
    quantization: str = flag(
        "none",
        "Weights: none (fp32), bf16 (linear weights and their inputs in bf16, fp32 sums; CPUs "
        "with AVX512-BF16) or q4_1 (the GGUF's own Q4_1 blocks, kept quantised and run on "
        "servelab's CPU kernels).",
        decls=("--quantization",),
    )


def generate(flags: GenerateFlags) -> None:
    """Generate text for one prompt and show its phase timeline."""
    require_engine("generate")
    from rich.console import Console

    from servelab.workflows.offline import GenerateSpec, run_generate

    spec = spec_from_flags(GenerateSpec, flags)
    try:
        run_generate(spec, Console())
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


@dataclass(frozen=True)
class OfflineDemoFlags:
    model: str = flag(DEFAULT_MODEL, "Short name, .gguf or HF dir.", decls=("--model", "-m"))
    device: str | None = flag(None, "cpu, cuda, ... (default: best).", decls=("--device",))
    max_num_batched_tokens: int = flag(
        256, "Token budget per step.", decls=("--max-num-batched-tokens",)
    )


def offline_demo(flags: OfflineDemoFlags) -> None:
    """Run a mixed offline batch (chat + a long RAG prompt) and show every request's phases."""
    require_engine("offline-demo")
    from servelab.workflows.offline import run_offline_demo

    run_offline_demo(flags.model, flags.device, flags.max_num_batched_tokens)


COMMANDS = {
    "generate": command_from_fields(GenerateFlags, generate),
    "offline-demo": command_from_fields(OfflineDemoFlags, offline_demo),
}
