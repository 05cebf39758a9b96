"""CLI commands of the model layer (registered by servelab.cli). No heavy imports at module level."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import typer

from servelab.cli.errors import fail
from servelab.cli.extras import require_engine
from servelab.cli.field_options import command_from_fields, flag
from servelab.vocab import DEFAULT_MODEL


@dataclass(frozen=True)
class ExportHfFlags:
    out_dir: Path = flag(..., "New or empty directory to write the model into.", argument=True)
    model: str = flag(DEFAULT_MODEL, "Short name, .gguf file or HF directory.")


def export_hf_command(flags: ExportHfFlags) -> None:
    """Write a model as a standard HF directory (config.json, model.safetensors, tokenizer)
    that transformers and vLLM load as-is. GGUF weights are dequantised to fp32."""
    require_engine("export-hf")
    import logging

    from servelab.model.hf_export import export_hf

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = export_hf(flags.model, flags.out_dir)
    except ValueError as e:
        raise fail(str(e)) from None
    typer.echo(f"wrote {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))


COMMANDS = {"export-hf": command_from_fields(ExportHfFlags, export_hf_command)}
