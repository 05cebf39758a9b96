"""The `servelab` command. Each subsystem registers its own commands.

Command modules import nothing heavy at module level (no torch), so that
`servelab bench` never loads the engine.
"""

from __future__ import annotations

import typer

from servelab import __version__

app = typer.Typer(
    name="servelab",
    help="See, measure and tune the two phases of LLM inference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register_all() -> None:
    from servelab.analyze import commands as analyze_commands
    from servelab.bench import commands as bench_commands
    from servelab.engine import commands as engine_commands
    from servelab.model import commands as model_commands
    from servelab.server import commands as server_commands
    from servelab.sim import commands as sim_commands

    for module in (
        engine_commands,
        model_commands,
        server_commands,
        bench_commands,
        analyze_commands,
        sim_commands,
    ):
        module.register(app)


@app.callback()
def _root() -> None:
    """See, measure and tune the two phases of LLM inference."""


@app.command()
def version() -> None:
    """Print servelab's version."""
    typer.echo(__version__)


_register_all()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
