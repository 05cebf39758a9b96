"""`servelab serve`: the OpenAI-compatible server. No heavy imports at module level.

Its options are ``ServerArgs``' fields (``servelab.server.server_args``), declared there once.
"""

from __future__ import annotations

import typer

from servelab.cli.errors import fail
from servelab.cli.extras import require_engine
from servelab.cli.field_options import command_from_fields
from servelab.server.server_args import ServerArgs


def serve(args: ServerArgs) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (completions, chat, metrics)."""
    require_engine("serve")
    from servelab.modelcore.catalogue import resolve_model

    try:
        args.validate()
        resolve_model(args.model)  # an unknown model fails now, not after a process start
        draft = args.engine_config().speculative()
        if draft is not None and draft.model is not None:
            resolve_model(draft.model)
    except ValueError as e:
        raise fail(str(e), "serve") from None

    from servelab.server.main import run_server

    raise typer.Exit(run_server(args))


COMMANDS = {"serve": command_from_fields(ServerArgs, serve)}
