"""The optional installs a command needs, checked before it starts anything.

The core ``pip install servelab`` runs bench (against a ``--url``), diagnose, compare,
report, export and sim. The engine (torch, the GGUF and safetensors readers, the engine-core
process's ZeroMQ) comes with ``pip install 'servelab[engine]'``; a command that needs it, run
without it, says so in one line and exits 2 (no traceback). The fits (scipy's optimizers:
``calibrate``, ``tune``, ``sim --as-run``, a profile table's cost model) come with
``pip install 'servelab[fit]'``; their imports stay inside the functions that fit, and the CLI
turns the missing module into the same one line (``missing_extra_message``).
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


# import name -> the extra that installs it, for a module imported only where it is used
EXTRA_OF_MODULE = {mod: "engine" for mod in ENGINE_MODULES} | {"scipy": "fit"}


def install_hint(extra: str) -> str:
    """The one-line instruction that installs ``extra``."""
    return f"pip install 'servelab[{extra}]'"


def missing_extra_message(error: ModuleNotFoundError) -> str | None:
    """The one line for a missing module that an extra installs; None for any other module."""
    top = (error.name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(top)
    if extra is None:
        return None
    dist = ENGINE_MODULES.get(top, top)
    return f"this needs {dist}, which is not installed: {install_hint(extra)}"


def missing_engine_modules() -> list[str]:
    """The engine extra's distributions that are not installed (found without importing them)."""
    return [dist for mod, dist in ENGINE_MODULES.items() if importlib.util.find_spec(mod) is None]


def require_engine(command: str) -> None:
    """Raise the CLI's one-line error (exit 2) when the engine extra is not installed."""
    missing = missing_engine_modules()
    if missing:
        raise fail(
            f"this needs the engine, which is not installed ({', '.join(missing)} missing): "
            + install_hint("engine"),
            command,
        )
