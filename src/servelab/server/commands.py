"""CLI commands of this subsystem (registered by servelab.cli). No heavy imports at module level."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this subsystem's commands to the `servelab` app."""
