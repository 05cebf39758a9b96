"""CLI commands of the model layer (registered by servelab.cli). No heavy imports at module level."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from servelab.cli.errors import fail
from servelab.cli.extras import require_engine


def export_hf_command(
    out_dir: Annotated[
        Path, typer.Argument(help="New or empty directory to write the model into.")
    ],
    model: Annotated[
        str, typer.Option(help="Short name, .gguf file or HF directory.")
    ] = "smollm2-135m",
) -> None:
    """Write a model as a standard HF directory (config.json, model.safetensors, tokenizer)
    that transformers and vLLM load as-is. GGUF weights are dequantised to fp32."""
    require_engine("export-hf")
    import logging

    from servelab.model.hf_export import export_hf

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = export_hf(model, out_dir)
    except ValueError as e:
        raise fail(str(e)) from None
    typer.echo(f"wrote {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))


COMMANDS = {"export-hf": export_hf_command}
