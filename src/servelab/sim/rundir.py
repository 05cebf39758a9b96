"""Write a simulated run as a run directory, in the format a real benchmark run has.

``requests.jsonl`` (ClientRecords), ``server.jsonl`` (RequestTimeline dicts),
``steps.jsonl`` (StepRecord dicts plus ``replica`` and ``role``), ``metrics.json``
(``analyze.summary.summarize``) and ``manifest.json`` with ``"simulated": true`` and
what was simulated. ``diagnose``, ``compare`` and ``report`` read it unchanged.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from servelab import __version__
from servelab.analyze.summary import DEFAULT_N_BOOT, SLO, summarize
from servelab.sim.loop import SimResult


def _jsonl(path: Path, rows: Any) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":")))
            f.write("\n")


def write_run_dir(
    path: str | Path,
    result: SimResult,
    *,
    target: dict[str, Any],
    workload: Any = None,
    load: dict[str, Any] | None = None,
    slos: SLO | dict[str, SLO] | None = None,
    command: list[str] | None = None,
    sim: dict[str, Any] | None = None,
    name: str | None = None,
    write_steps: bool = True,
    n_boot: int | None = None,
) -> Path:
    """Write ``result`` under ``path`` (created); return the directory.

    ``target`` describes the simulated deployment (``SimTarget.describe()``); it becomes
    the manifest's ``server`` entry, as a real run records its server. ``n_boot``
    (bootstrap resamples for the confidence intervals) defaults to the summary's own
    default, cut to 100 for runs over 5,000 requests, whose pooled ITL runs to millions.
    """
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    _jsonl(d / "requests.jsonl", (r.to_dict() for r in result.records))
    _jsonl(d / "server.jsonl", (t.to_dict() for t in result.timelines))
    if write_steps:
        _jsonl(d / "steps.jsonl", result.steps)
    if n_boot is None:
        n_boot = DEFAULT_N_BOOT if len(result.records) <= 5000 else 100
    metrics = summarize(result.records, slos=slos, n_boot=n_boot)
    (d / "metrics.json").write_text(json.dumps(metrics, indent=1))
    manifest = {
        "name": name or d.name,
        "simulated": True,
        "target_kind": "servelab",
        "command": command if command is not None else sys.argv,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": {"servelab": __version__, "python": platform.python_version()},
        "machine": {"host": platform.node(), "platform": platform.platform()},
        "model": target.get("model"),
        "server": {
            "kind": "servelab-sim",
            "model": target.get("model"),
            "engine_config": target.get("engine_config", {}),
            "simulated": target,
        },
        "workload": workload,
        "load": load,
        "slos": {k: v.to_dict() for k, v in slos.items()}
        if isinstance(slos, dict)
        else (slos.to_dict() if slos else None),
        "window": metrics["window"],
        "sim": {
            "topology": result.topology.describe(),
            "num_steps": result.num_steps,
            "sim_duration_s": result.sim_duration,
            "replicas": result.replicas,
            **(sim or {}),
        },
    }
    (d / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str))
    return d
