"""`servelab bench --matrix FILE`: one workload against several engine configs, compared.

The matrix file names the configurations (flags for the embedded `servelab serve`) and
the number of repeats; the workload and load come from the `servelab bench` command line
(the ``BenchOptions`` it parsed), so every config sees the same planned requests::

    repeats: 2
    configs:
      chunked-512: "--max-num-batched-tokens 512"
      unchunked: "--no-enable-chunked-prefill"
      # a config may also change the workload (e.g. class priorities):
      prio: {engine_args: "", workload: my-priorities.yaml}

Another server (vLLM, SGLang, llama-server) is launched from a command template
(``bench.servers.template``) instead of `servelab serve`: each config's flags fill its ``{flags}``,
``model`` fills ``{model}``, and a config may give a template of its own::

    template: "vllm serve {model} --host {host} --port {port} {flags}"
    model: /models/llama-8b
    configs:
      chunked-512: "--max-num-batched-tokens 512"
      unchunked: "--no-enable-chunked-prefill"

One server per config is started up front and kept for the session; repeat ``r`` runs
every config in an order rotated by ``r``, so machine drift spreads over all configs
instead of biasing whichever ran last. Each run is a normal run directory
(``<out>/<config>-r<k>``); the comparison pools each config's repeats
(``analyze.compare``) and is written to ``matrix.json`` and ``report.html``.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.markup import escape

from servelab.analyze.compare import Comparison, compare
from servelab.bench.run import DEFAULT_MODEL, BenchOptions, run_bench
from servelab.bench.servers.target import LaunchedServer
from servelab.bench.servers.template import HEALTH_TIMEOUT_S, TemplateServer
from servelab.engine_flags import read_flags
from servelab.rundir import Run, load_run, read_json, write_manifest

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.=+-]*$")


@dataclass
class MatrixConfig:
    name: str
    engine_args: str = ""
    workload: str | None = None  # None: the command line's workload
    template: str | None = None  # another server's launch command (None: the matrix's)


@dataclass
class MatrixSpec:
    configs: list[MatrixConfig]
    repeats: int = 1
    template: str | None = None  # launch every config from this (bench.servers.template)
    model: str | None = None  # the template's {model} (default: bench --model)
    # repeat r plans its requests with seed ``seeds[r]``, the same for every config (None:
    # every run the command line's seed)
    seeds: list[int] | None = None

    @classmethod
    def parse(cls, data: Any, source: str = "the matrix") -> MatrixSpec:
        """From a dict; raises ValueError saying what to write instead."""
        example = 'configs: {chunked: "--max-num-batched-tokens 512", unchunked: "--no-enable-chunked-prefill"}'
        if not isinstance(data, dict) or "configs" not in data:
            raise ValueError(f"{source} needs a 'configs' mapping, e.g. {example}")
        unknown = set(data) - {"configs", "repeats", "template", "model"}
        if unknown:
            raise ValueError(
                f"{source}: unknown key(s) {sorted(unknown)}; use configs, repeats, template "
                "and model"
            )
        raw = data["configs"]
        if not isinstance(raw, dict) or len(raw) < 2:
            raise ValueError(f"{source}: give at least two configs to compare, e.g. {example}")
        configs = []
        for name, v in raw.items():
            name = str(name)
            if not _NAME_RE.match(name):
                raise ValueError(
                    f"{source}: config name {name!r} must be letters, digits and _.=+- "
                    "(it names a run directory)"
                )
            if v is None or isinstance(v, str):
                configs.append(MatrixConfig(name, v or ""))
            elif isinstance(v, dict) and set(v) <= {"engine_args", "workload", "template"}:
                configs.append(
                    MatrixConfig(
                        name, v.get("engine_args") or "", v.get("workload"), v.get("template")
                    )
                )
            else:
                raise ValueError(
                    f"{source}: config {name!r} must be a string of the server's flags or "
                    "{engine_args: ..., workload: ..., template: ...}"
                )
        repeats = data.get("repeats", 1)
        if not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"{source}: repeats must be a whole number >= 1, got {repeats!r}")
        for key in ("template", "model"):
            if data.get(key) is not None and not isinstance(data[key], str):
                raise ValueError(f"{source}: {key} must be a string")
        return cls(configs, repeats, data.get("template"), data.get("model"))

    @classmethod
    def load(cls, path: str | Path) -> MatrixSpec:
        p = Path(path)
        if not p.exists():
            raise ValueError(f"no matrix file at {p}: write a YAML file with 'configs:' (see docs)")
        if p.suffix == ".toml":
            import tomllib

            data = tomllib.loads(p.read_text())
        else:
            try:
                data = yaml.safe_load(p.read_text())
            except yaml.YAMLError as e:
                raise ValueError(f"{p} is not valid YAML: {e}") from None
        return cls.parse(data, str(p))

    def order(self) -> list[tuple[int, MatrixConfig]]:
        """(repeat, config) in execution order: each repeat rotates the config order."""
        n = len(self.configs)
        return [(r, self.configs[(r + i) % n]) for r in range(self.repeats) for i in range(n)]


@dataclass
class MatrixResult:
    out: Path
    runs: dict[str, list[Path]] = field(default_factory=dict)  # config -> its run dirs
    exit_codes: dict[str, int] = field(default_factory=dict)  # run dir name -> bench's code
    groups: list[list[Run]] = field(default_factory=list)  # loaded runs of configs that ran
    comparison: Comparison | None = None


def has_records(run_dir: Path) -> bool:
    """Whether a bench run left at least one client record (an early stop may leave none)."""
    path = run_dir / "requests.jsonl"
    return path.exists() and path.stat().st_size > 0


def record_server(run_dir: Path, server: LaunchedServer | TemplateServer) -> None:
    """Write the launched server's flags into the run's manifest: the bench saw only a URL."""
    manifest = read_json(run_dir, "manifest.json")
    if manifest is None:
        return
    info = manifest.get("server") or {}
    info.update(
        launched=True,
        command=server.command,
        engine_args=server.engine_args,
        config=server.config
        if isinstance(server, TemplateServer)
        else read_flags(server.engine_args),
    )
    if isinstance(server, TemplateServer):
        info["template"] = server.template  # redacted: `tune --verify` relaunches from it
    manifest["server"] = info
    write_manifest(run_dir, manifest)


def bench_logged(
    opts: BenchOptions, console: Console, on_run: Callable[[Path, int], None] | None
) -> int:
    """``run_bench``, its output to ``console``, or with ``on_run`` to ``bench.txt`` in the run
    directory (the caller prints its own line per run)."""
    if on_run is None:
        return run_bench(opts, console)
    buf = io.StringIO()
    code = run_bench(opts, Console(file=buf, width=100, force_terminal=False))
    if opts.out is not None and opts.out.is_dir():
        (opts.out / "bench.txt").write_text(buf.getvalue())
    return code


def start_servers(
    engine_args: dict[str, str],
    out: Path,
    model: str = DEFAULT_MODEL,
    api_key: str | None = None,
    console: Console | None = None,
    templates: dict[str, str | None] | None = None,
    health_timeout: float = HEALTH_TIMEOUT_S,
    announce: Callable[[str], None] | None = None,
) -> dict[str, LaunchedServer | TemplateServer]:
    """Start one server per name, all at once, and wait until every one is healthy (within
    ``health_timeout`` seconds): the `servelab serve` the name's flags configure, or where
    ``templates`` gives the name a template, that command with the flags as its ``{flags}``
    (``bench.servers.template``). Each command is printed before it runs (or given to
    ``announce``, with the warnings of servers an earlier crash left running,
    ``bench.servers.lifetime.stale``; every server's log starts with its command too).

    On failure the ones already started are stopped before the error propagates; the
    servers die with this process however it ends (``bench.servers.lifetime``).
    """
    console = console or Console()

    def say(line: str) -> None:  # to stderr where the console is quiet (--json)
        if console.quiet:
            print(line, file=sys.stderr, flush=True)
        else:
            console.print(escape(line))

    announce = announce or say

    servers: dict[str, LaunchedServer | TemplateServer] = {}
    try:
        for name, args in engine_args.items():
            log = out / f"server-{name}.log"
            template = (templates or {}).get(name)
            if template:
                servers[name] = TemplateServer(template, log, model, args, announce=announce)
            else:
                servers[name] = LaunchedServer(model, args, log, api_key, announce=announce)

        async def wait_all() -> None:
            await asyncio.gather(*(s.wait_healthy(health_timeout) for s in servers.values()))

        with console.status(f"starting {len(servers)} server process(es) ..."):
            asyncio.run(wait_all())
    except BaseException:
        for srv in servers.values():
            srv.stop()
        raise
    return servers


def execute_matrix(
    spec: MatrixSpec,
    base: BenchOptions,
    console: Console | None = None,
    servers: dict[str, Any] | None = None,
    on_run: Callable[[Path, int], None] | None = None,
) -> MatrixResult:
    """Run every (repeat, config) in interleaved order and compare the configs.

    ``servers`` (config name -> a healthy server started with that config's flags) lets a
    caller reuse servers it already started; otherwise they are started here and stopped
    at the end. With ``on_run``, each bench's own output goes to ``bench.txt`` in its run
    directory instead of ``console``, and ``on_run(run_dir, exit code)`` is called after it.
    """
    console = console or Console()
    if base.url is not None:
        raise ValueError("--matrix starts its own servers (one per config); drop --url")
    if base.sweep is not None or base.find_max_rate:
        raise ValueError("--matrix runs one load per config; drop --sweep / --find-max-rate")
    out = base.out or Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-matrix"
    out.mkdir(parents=True, exist_ok=True)
    model = spec.model or base.model or DEFAULT_MODEL
    own = servers is None
    if servers is None:
        args = {
            c.name: " ".join(a for a in (base.engine_args, c.engine_args) if a)
            for c in spec.configs
        }
        templates = {c.name: c.template or spec.template for c in spec.configs}
        servers = start_servers(args, out, model, base.api_key, console, templates)
    result = MatrixResult(out, {c.name: [] for c in spec.configs})
    try:
        plan = spec.order()
        for k, (rep, c) in enumerate(plan, 1):
            run_dir = out / f"{c.name}-r{rep}"
            if on_run is None:
                console.rule(
                    f"[bold]matrix {k}/{len(plan)}: {c.name} (repeat {rep + 1}/{spec.repeats})"
                )
            opts = replace(
                base,
                url=servers[c.name].url,
                engine_args="",
                model=None,
                tokenizer=base.tokenizer or model,
                workload=c.workload or base.workload,
                out=run_dir,
                seed=spec.seeds[rep] if spec.seeds else base.seed,
            )
            result.exit_codes[run_dir.name] = bench_logged(opts, console, on_run)
            record_server(run_dir, servers[c.name])
            if on_run is not None:
                on_run(run_dir, result.exit_codes[run_dir.name])
            if (run_dir / "requests.jsonl").exists() and (
                run_dir / "requests.jsonl"
            ).stat().st_size:
                result.runs[c.name].append(run_dir)
            if result.exit_codes[run_dir.name] == 130:
                break
    finally:
        if own:
            for srv in servers.values():
                srv.stop()
    result.groups = [[load_run(p) for p in paths] for paths in result.runs.values() if paths]
    if len(result.groups) >= 2:
        result.comparison = compare(result.groups, [n for n, p in result.runs.items() if p])
    return result


def run_matrix(
    spec: MatrixSpec | str | Path, base: BenchOptions, console: Console | None = None
) -> int:
    """The `servelab bench --matrix` entry point: run, print the comparison, write the report.

    Returns 0, 3 when any run was invalid, 130 when interrupted, 2 on bad input.
    """
    from servelab.analyze.diagnosis.diagnose import diagnose
    from servelab.report.html import write_report
    from servelab.report.terminal import render_comparison

    console = console or Console()
    try:
        s = spec if isinstance(spec, MatrixSpec) else MatrixSpec.load(spec)
        result = execute_matrix(s, base, console)
    except (ValueError, RuntimeError) as e:
        console.print(f"[red]servelab bench --matrix: error:[/] {e}")
        return 2
    codes = list(result.exit_codes.values())
    if result.comparison is not None:
        render_comparison(result.comparison, console)
        groups = result.groups
        runs = [r for g in groups for r in g]
        report = write_report(
            runs,
            [diagnose(r) for r in runs],
            result.out / "report.html",
            result.comparison,
            title=f"servelab matrix: {', '.join(result.runs)}",
            groups=groups,
        )
        (result.out / "matrix.json").write_text(
            json.dumps(
                {
                    "configs": [c.__dict__ for c in s.configs],
                    "repeats": s.repeats,
                    "order": [f"{c.name}-r{r}" for r, c in s.order()],
                    "exit_codes": result.exit_codes,
                    "comparison": result.comparison.to_dict(),
                },
                indent=1,
                default=str,
            )
        )
        console.print(f"matrix report: {report.resolve()}")
    if 130 in codes:
        return 130
    return 3 if any(c == 3 for c in codes) else 0
