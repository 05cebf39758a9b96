"""Write a simulated run as a run directory, with the benchmark's own writer (``RunDir``).

``requests.jsonl`` (ClientRecords), ``server.jsonl`` (RequestTimeline dicts),
``steps.jsonl`` (StepRecord dicts plus ``replica`` and ``role``), ``metrics.json``
(``analyze.summary.summarize``) and ``manifest.json`` with ``"simulated": true`` and
what was simulated. ``diagnose``, ``compare`` and ``report`` read it unchanged.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from servelab.analyze.stats import DEFAULT_N_BOOT
from servelab.analyze.summary import summarize
from servelab.bench.manifest import machine, versions
from servelab.rundir import RunDir
from servelab.sim.loop.simulation import SimResult, cyclic_gc_paused
from servelab.units import SLO


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
    overlap: bool = True,
) -> Path:
    """Write ``result`` under ``path`` (created); return the directory.

    ``target`` describes the simulated deployment (``SimTarget.describe()``); it becomes
    the manifest's ``server`` entry, as a real run records its server. ``n_boot``
    (bootstrap resamples for the confidence intervals) defaults to the summary's own
    default, cut to 100 for runs over 5,000 requests, whose pooled ITL runs to millions.
    ``overlap`` writes the JSONL files on a second thread while the main one summarizes:
    the files' writes and numpy's long loops release the GIL, so on a second core they
    take no time of their own; False does one after the other (the same bytes).
    """
    with cyclic_gc_paused():  # see there: a full collection here walked the whole run
        out = RunDir(path)

        def write_jsonl() -> None:
            try:
                out.add_records(result.records)
                out.add_timelines([t.to_dict() for t in result.timelines])
                if write_steps:
                    out.add_steps(result.steps)
            finally:
                out.close()

        if n_boot is None:
            n_boot = DEFAULT_N_BOOT if len(result.records) <= 5000 else 100
        if overlap:
            with ThreadPoolExecutor(1) as pool:  # waits for the files even if summarize raises
                written = pool.submit(write_jsonl)
                metrics = summarize(result.records, slos=slos, n_boot=n_boot)
                written.result()
        else:
            write_jsonl()
            metrics = summarize(result.records, slos=slos, n_boot=n_boot)
        out.write_json("metrics.json", metrics)
        manifest = {
            "name": name or out.path.name,
            "simulated": True,
            "target_kind": "servelab",
            "command": command if command is not None else sys.argv,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "versions": versions(),
            "machine": machine(),
            "model": target.get("model"),
            "server": {
                "kind": "servelab-sim",
                "model": target.get("model"),
                "max_model_len": target.get("max_model_len"),
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
        out.write_manifest(manifest)
        return out.path
