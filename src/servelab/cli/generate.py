"""`servelab generate` and `servelab offline-demo`: one in-process engine, no server.

No heavy imports at module level (the engine and torch load inside the commands).
"""

from __future__ import annotations

import typer

from servelab.cli.extras import require_engine


def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt text."),
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Short name, .gguf or HF dir."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 means greedy."),
    seed: int | None = typer.Option(None, "--seed", help="Seed for sampling."),
    chat: bool = typer.Option(True, "--chat/--raw", help="Wrap the prompt in the chat template."),
    device: str | None = typer.Option(None, "--device", help="cpu, cuda, ... (default: best)."),
    quantization: str = typer.Option(
        "none",
        "--quantization",
        help="Weights: none (fp32), bf16 (linear weights and their inputs in bf16, fp32 sums; CPUs "
        "with AVX512-BF16) or q4_1 (the GGUF's own Q4_1 blocks, kept quantised and run on "
        "servelab's CPU kernels).",
    ),
) -> None:
    """Generate text for one prompt and show its phase timeline."""
    require_engine("generate")
    from rich.console import Console

    from servelab.engine.engine_config import EngineConfig
    from servelab.engine.sampling_params import SamplingParams
    from servelab.model.build import build_engine
    from servelab.report.terminal import phase_table
    from servelab.vocab import check_quantization
    from servelab.workflows.offline import chat_ids

    console = Console()
    try:
        check_quantization(quantization)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    try:
        sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        engine = build_engine(model, EngineConfig(), device=device, quantization=quantization)
        if chat:
            engine.add_request(
                "generate-0", prompt_token_ids=chat_ids(engine, prompt), sampling_params=sp
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


def offline_demo(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Short name, .gguf or HF dir."),
    device: str | None = typer.Option(None, "--device", help="cpu, cuda, ... (default: best)."),
    max_num_batched_tokens: int = typer.Option(
        256, "--max-num-batched-tokens", help="Token budget per step."
    ),
) -> None:
    """Run a mixed offline batch (chat + a long RAG prompt) and show every request's phases."""
    require_engine("offline-demo")
    from servelab.workflows.offline import run_offline_demo

    run_offline_demo(model, device, max_num_batched_tokens)


COMMANDS = {"generate": generate, "offline-demo": offline_demo}
