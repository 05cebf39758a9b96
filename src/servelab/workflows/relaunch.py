"""How `tune --verify` relaunches the embedded server a run was served by: as it was, or not.

The run's manifest records its server (``server``): the command servelab launched it with
(``--model``), the flags it was given (``engine_args``), the engine config it resolved
(``engine_config``) and what its engine core reported (``version.engine``: the model, the
weights' quantization, the torch threads, the device). :func:`embedded_relaunch` turns them
into `servelab serve` flags: every recorded flag, then the resolved config, then the
quantization, threads and device, so that what the core ran with wins over what a flag
asked (the last flag wins). Whatever it needs and the manifest lacks is named in a
:class:`NotRelaunchable`, never filled from today's defaults (the default model included).
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass
from typing import Any

from servelab.analyze.tuning.candidates import serve_flags
from servelab.bench.manifest import HIDDEN
from servelab.engine_flags import read_flags
from servelab.rundir import Run
from servelab.sim.fit.asrun import engine_config_of


class NotRelaunchable(ValueError):
    """The run's manifest does not say how to serve it again; the message names what."""


@dataclass(frozen=True)
class Relaunch:
    """`servelab serve --model MODEL FLAGS` as the run was served."""

    model: str
    flags: str


def _flag(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def as_run_engine(run: Run) -> dict[str, Any]:
    """The run's resolved engine config as launch settings (the KV pool by its block count)."""
    cfg = dataclasses.asdict(engine_config_of(run))
    return {k: v for k, v in cfg.items() if v is not None and k != "kv_cache_memory_gb"}


def embedded_relaunch(run: Run) -> Relaunch:
    """The model and `servelab serve` flags that serve ``run`` as it was served (see the
    module doc). NotRelaunchable naming what the manifest does not record."""
    if run.simulated:
        raise NotRelaunchable(
            f"--verify: {run.name} ran in the simulator, so there is no server to relaunch; "
            "verify a run of `servelab bench`"
        )
    server = run.server
    version = server.get("version")
    core = version.get("engine") if isinstance(version, dict) else None
    core = core if isinstance(core, dict) else {}
    command = server.get("command") if isinstance(server.get("command"), list) else []
    args = server.get("engine_args") or ""
    given = read_flags(args)
    missing = []
    model = _flag([str(a) for a in command], "--model") or core.get("model")
    if not model:
        missing.append("the model it served (server.command's --model, version.engine.model)")
    quantization = core.get("quantization") or given.get("quantization")
    if not quantization:
        missing.append("the weights' quantization (version.engine.quantization)")
    threads = core.get("torch_threads") or given.get("threads")
    if not threads:
        missing.append("the engine core's threads (version.engine.torch_threads)")
    if not run.engine_config:
        missing.append("the engine config (server.engine_config)")
    if HIDDEN in args:
        missing.append(f"the secret its flags carried (engine_args {args!r}, redacted)")
    if missing:
        raise NotRelaunchable(
            f"--verify relaunches the server {run.name} was served by, and its manifest does "
            f"not record {'; '.join(missing)}: relaunching without it would measure another "
            "server"
        )
    # "auto" is what a core reports when `serve` was given no --device: the relaunch then
    # makes the same choice on this machine (serve takes no --device auto)
    device = core.get("device") if core.get("device") != "auto" else None
    own = [
        f"--quantization {shlex.quote(str(quantization))}",
        f"--threads {int(threads)}",
        *([f"--device {shlex.quote(str(device))}"] if device else []),
    ]
    flags = " ".join(a for a in (args, serve_flags(as_run_engine(run)), *own) if a)
    return Relaunch(str(model), flags)
