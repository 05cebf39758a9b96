"""The optional installs a command needs, checked before it starts anything.

The core ``pip install servelab`` runs bench (against a ``--url``), diagnose, compare,
report, export and sim. The engine (torch, the GGUF and safetensors readers, the engine-core
process's ZeroMQ) comes with ``pip install 'servelab[engine]'``; a command that needs it, run
without it, says so in one line and exits 2 (no traceback).
"""

from __future__ import annotations

import importlib.util

from servelab.cli.errors import fail

# import name -> distribution name, for the message
ENGINE_MODULES = {
    "torch": "torch",
    "gguf": "gguf",
    "safetensors": "safetensors",
    "zmq": "pyzmq",
    "threadpoolctl": "threadpoolctl",
}


def missing_engine_modules() -> list[str]:
    """The engine extra's distributions that are not installed (found without importing them)."""
    return [dist for mod, dist in ENGINE_MODULES.items() if importlib.util.find_spec(mod) is None]


def require_engine(command: str) -> None:
    """Raise the CLI's one-line error (exit 2) when the engine extra is not installed."""
    missing = missing_engine_modules()
    if missing:
        raise fail(
            f"this needs the engine, which is not installed ({', '.join(missing)} missing): "
            "pip install 'servelab[engine]'",
            command,
        )
