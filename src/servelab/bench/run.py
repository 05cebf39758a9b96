"""`servelab bench` end to end: target, plan, stages, recording, summary, verdict.

``run_bench(options)`` is what the CLI calls. A run has one stage (one load), or
several for ``--sweep`` and ``--find-max-rate``; before each stage the server's
prefix cache is flushed where it allows it. Each stage gets its own client-health
check and summary; the run is invalid if any stage's client was the bottleneck.
"""

from __future__ import annotations

import contextlib
import gc
import os
import secrets
import shlex
import sys
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from servelab.analyze.server_side.promscrape import parse_scrapes
from servelab.analyze.server_side.timeseries import ServerSeries, server_series
from servelab.analyze.similarity import ideal_prefix_reuse
from servelab.analyze.summary import measured_window, summarize
from servelab.analyze.timeslices import DEFAULT_SLICE_DURATION
from servelab.bench.client.event_loop import run_loop
from servelab.bench.client.http import HttpClient
from servelab.bench.client.monitor import ClientHealth, LoopMonitor
from servelab.bench.client.requestid import RequestIdHeader
from servelab.bench.client.send import Target
from servelab.bench.client.servertok import SERVER_TOKENIZER, ServerTokenizer
from servelab.bench.datasets import Dataset, load_dataset
from servelab.bench.distributed.clock import timing_error_budget
from servelab.bench.manifest import machine, redact, versions
from servelab.bench.plan_runner import PlanRunner, StageResult
from servelab.bench.progress import Progress
from servelab.bench.search import find_max_rate, saturated, sweep_stop
from servelab.bench.servers.collect import SCRAPE_INTERVAL, MetricsScraper, TimelineCollector
from servelab.bench.servers.target import LaunchedServer, ServerInfo, probe, reset_prefix_cache
from servelab.bench.workloads.request_plan import ENDPOINTS, LoadSpec, Plan, build_plan, iter_plan
from servelab.bench.workloads.spec import DatasetSource, WorkloadSpec, load_workload, parse_workload
from servelab.report.terminal import (
    fit,
    print_timeslices,
    rates_table,
    similarity_line,
    stages_table,
    summary_table,
)
from servelab.rundir import RunDir, read_jsonl
from servelab.units import SLO, Trim
from servelab.vocab import DEFAULT_MODEL, ClientRecord

if TYPE_CHECKING:
    from servelab.bench.distributed.driver import DistributedStage, WorkerPool

DEFAULT_WORKLOAD = "chat"


@dataclass
class BenchOptions:
    """Everything the command line says, already parsed (``servelab.cli.bench``); the load
    comes from ``LoadSpec.from_flags``. ``validate`` checks what each flag allows."""

    url: str | None = None
    model: str | None = None
    tokenizer: str | None = None
    api_key: str | None = None
    workload: str | None = None
    load: LoadSpec = field(default_factory=LoadSpec)
    slo: SLO | None = None
    sweep: tuple[str, list[float]] | None = None
    find_max_rate: bool = False
    goodput_target: float = 0.9
    search_steps: int = 3
    out: Path | None = None
    engine_args: str = ""
    server_config: str | None = None  # another server's launch command, as the user states it
    seed: int = 0
    endpoint: str = "completions"
    warmup: Trim = field(default_factory=Trim)
    cooldown: Trim = field(default_factory=Trim)
    quiet: bool = False
    strict_openai: bool = False
    request_id_header: bool = True  # X-Request-Id: a UUID per request (bench/client/requestid.py)
    cold_connections: bool = False  # connections opened inside the window (bench/plan_runner.py)
    timeout: float = 600.0
    command: list[str] = field(default_factory=list)  # argv with the API key redacted
    overwrite: bool = False
    dataset: DatasetSource | None = None  # --dataset and its flags: every class's text
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, extra body
    workers: int = 1  # > 1: local worker processes (bench.distributed)
    ray_address: str | None = None  # run the workers as Ray actors on this cluster
    scrape_interval: float = SCRAPE_INTERVAL  # seconds between /metrics scrapes
    slice_duration: float = DEFAULT_SLICE_DURATION  # seconds per time window (timeslices)

    @property
    def distributed(self) -> bool:
        return self.workers > 1 or self.ray_address is not None

    def validate(self) -> None:
        """Raise ValueError naming the flag that is wrong and saying what to do."""
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url {self.url!r}: give a base URL such as http://127.0.0.1:8000")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint {self.endpoint!r}: use completions or chat")
        if self.load.trace is not None and self.workload is not None:
            raise ValueError("--trace sets its own lengths and arrivals; drop --workload")
        if self.workers < 1:
            raise ValueError(f"--workers {self.workers}: give 1 or more")
        if self.ray_address is not None:
            from servelab.bench.distributed.ray_workers import check_address

            check_address(self.ray_address)
        if not 0.05 <= self.scrape_interval <= 60:
            raise ValueError(f"--scrape-interval {self.scrape_interval:g}s: give 50ms to 60s")
        if not 0.1 <= self.slice_duration <= 3600:
            raise ValueError(f"--slice-duration {self.slice_duration:g}s: give 100ms to 1h")
        if not 0 < self.goodput_target <= 1:
            raise ValueError(f"--goodput-target {self.goodput_target}: give a fraction in (0, 1]")
        self.load.validate()


@dataclass
class Stage:
    label: str | None
    load: LoadSpec
    result: StageResult | None = None
    health: ClientHealth | None = None
    summary: dict[str, Any] | None = None
    cache_reset: str = ""
    plan_info: dict[str, Any] = field(default_factory=dict)


def _load_tokenizer(name: str) -> Any:
    from servelab.modelcore.tokenizer import Tokenizer

    try:
        return Tokenizer.from_model(name)
    except ValueError as e:
        raise ValueError(f"cannot load tokenizer {name!r}: {e} (set --tokenizer)") from None


def _stages(opts: BenchOptions) -> list[Stage]:
    if opts.sweep is None:
        return [Stage(None, opts.load)]
    kind, values = opts.sweep
    out = []
    for v in values:
        if kind == "rate":
            load = replace(opts.load, rate=v, concurrency=None)
        else:
            load = replace(opts.load, concurrency=int(v), rate=None)
        out.append(Stage(f"{kind}={v:g}", load))
    return out


class Bench:
    """One invocation of ``servelab bench``."""

    def __init__(self, opts: BenchOptions, console: Console) -> None:
        self.o = opts
        self.console = console
        self.run_tag = secrets.token_hex(3)
        self.rundir: RunDir | None = None
        self.info: ServerInfo | None = None
        self.launched: LaunchedServer | None = None
        self.spec: WorkloadSpec | None = None
        self.tokenizer: Any = None
        self.tokenizer_source: str | None = None  # --tokenizer, --model, server /tokenize, ...
        self.stages: list[Stage] = []
        self.interrupted = False
        self.max_rate: dict[str, Any] | None = None
        self.warnings: list[str] = []
        self.request_ids: RequestIdHeader | None = None
        self.stamping: str | None = None
        self.pool: WorkerPool | None = None
        self.datasets: dict[tuple[str, str | None, str | None], Dataset] = {}

    # ------------------------------------------------------------------ set-up

    def _out_dir(self) -> Path:
        if self.o.out is not None:
            return self.o.out
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        what = (
            Path(self.o.workload).stem
            if self.o.workload
            else Path(self.o.dataset.dataset).stem
            if self.o.dataset
            else "trace"
            if self.o.load.trace
            else "run"
        )
        return Path("runs") / f"{stamp}-{what}"

    async def _target(self) -> None:
        o = self.o
        assert self.rundir is not None
        if o.url is None:
            self.launched = LaunchedServer(
                o.model or DEFAULT_MODEL, o.engine_args, self.rundir.server_log, o.api_key
            )
            with self.console.status(f"starting servelab serve on {self.launched.url} ...") as st:
                await self.launched.wait_healthy(status=st)
            url = self.launched.url
        else:
            if o.engine_args:
                raise ValueError(
                    "--engine-args only applies to the embedded server; drop it or --url"
                )
            url = o.url.rstrip("/")
        self.info = await probe(url, o.api_key)
        if o.server_config:
            self.info.stated_command = redact(shlex.split(o.server_config))
        if self.launched is not None:
            self.info.launched = True
            self.info.command = self.launched.command
            self.info.engine_args = o.engine_args
        if not self.info.models and o.model is None:
            raise ValueError(f"{url}/v1/models lists no model; name one with --model")

    def _plan_inputs(self) -> None:
        o = self.o
        if o.load.trace is None or o.dataset is not None:  # a trace's text may be a dataset's
            self.spec = self._workload()
            self._read_datasets()
        if o.tokenizer == SERVER_TOKENIZER:
            return  # asked of the server once it is probed (_server_tokenizer)
        if o.tokenizer is not None:
            self.tokenizer, self.tokenizer_source = _load_tokenizer(o.tokenizer), "--tokenizer"
            return
        if o.model is not None:
            # the served model's own tokenizer when --model names one servelab can read
            with contextlib.suppress(ValueError):
                self.tokenizer, self.tokenizer_source = _load_tokenizer(o.model), "--model"
                return
        if o.url is not None:
            return  # the server's /tokenize where it has one (_server_tokenizer)
        self._default_tokenizer()

    def _default_tokenizer(self) -> None:
        """The default model's tokenizer, which ships inside servelab (no package, no network)."""
        if self.o.url is not None or self.o.model is not None:
            self.warnings.append(
                f"no --tokenizer given: prompt lengths are exact under {DEFAULT_MODEL}'s "
                "tokenizer (shipped with servelab), which may not be the target's"
            )
        self.tokenizer, self.tokenizer_source = _load_tokenizer(DEFAULT_MODEL), "default model"

    def _tokenizer_lines(self) -> list[str]:
        """Which tokenizer built the prompts, and what that means for the token counts."""
        lines = [
            f"prompt lengths: tokenizer {getattr(self.tokenizer, 'name', '?')} "
            f"(source: {self.tokenizer_source})"
        ]
        if self.tokenizer_source == "server /tokenize":
            lines.append("  the server's own count; output tokens: its usage, else one per chunk")
            return lines
        if self.tokenizer_source == "default model" and self.o.url is not None:
            lines.append(
                "  shipped with servelab: lengths are exact under it, approximate under the "
                "target's own (--tokenizer)"
            )
        lines.append(
            "  token counts: the server's usage where it sends one, else this tokenizer's re-count"
        )
        return lines

    def _server_tokenizer(self) -> None:
        """No local tokenizer for the target's model: its own ``/tokenize``, else the default
        model's (``--tokenizer server`` insists on the server's)."""
        assert self.info is not None
        o = self.o
        tok = None
        if o.endpoint != "chat":  # a chat template is applied locally; /tokenize has none
            with self.console.status(f"asking {self.info.url}/tokenize for prompt lengths ..."):
                tok = ServerTokenizer.probe(self.info.url, self._request_model(), o.api_key)
        if tok is not None:
            self.tokenizer, self.tokenizer_source = tok, "server /tokenize"
        elif o.tokenizer == SERVER_TOKENIZER:
            why = (
                "--endpoint chat applies a chat template locally"
                if o.endpoint == "chat"
                else (
                    f"{self.info.url} answers no POST /tokenize (vLLM's, SGLang's or llama.cpp's)"
                )
            )
            raise ValueError(f"--tokenizer server: {why}; give a local --tokenizer")
        else:
            self._default_tokenizer()

    def _workload(self) -> WorkloadSpec:
        """The workload; ``--dataset`` gives every class its text (alone: one plain class)."""
        o = self.o
        if o.dataset is None:
            return load_workload(o.workload or DEFAULT_WORKLOAD)
        if o.workload is None:
            name = Path(o.dataset.dataset).stem
            return parse_workload(
                {"name": name, "classes": [{"name": name, "source": o.dataset.model_dump()}]},
                "--dataset",
            )
        return load_workload(o.workload).with_dataset(o.dataset)

    def _read_datasets(self) -> None:
        """Read every dataset file once, before a server starts or a request is sent."""
        assert self.spec is not None
        for cls in self.spec.classes:
            src = cls.source
            if src is not None and src.key() not in self.datasets:
                ds = load_dataset(src.dataset, src.format, src.field)
                self.datasets[src.key()] = ds
                self.warnings.extend(ds.warnings)

    def _request_model(self) -> str:
        assert self.info is not None
        return (
            self.o.model
            if (self.o.model and self.o.url)
            else (self.info.model_id or self.o.model or "")
        )

    async def _start_workers(self, target: Target) -> WorkerPool:
        from servelab.bench.distributed.driver import WorkerPool

        o = self.o
        where = f"Ray actors on {o.ray_address}" if o.ray_address else "local processes"
        with self.console.status(f"starting {o.workers} bench workers ({where}) ..."):
            pool = await WorkerPool.start(
                o.workers, target, ray_address=o.ray_address, tag=self.run_tag
            )
        if o.ray_address is None and o.workers > (os.cpu_count() or 1):
            self.warnings.append(
                f"{o.workers} worker processes on {os.cpu_count()} CPUs: they compete for "
                "cores (each worker's self-check says if it was starved)"
            )
        return pool

    # ------------------------------------------------------------------ stages

    def _plan(self, stage: Stage) -> Plan | Any:
        kw = {
            "tokenizer": self.tokenizer,
            "endpoint": self.o.endpoint,
            "max_model_len": self.info.max_model_len if self.info else None,
            "datasets": self.datasets,
        }
        if stage.load.closed and stage.load.requests is None and stage.load.trace is None:
            return iter_plan(self.spec, stage.load, self.o.seed, info=stage.plan_info, **kw)
        plan = build_plan(self.spec, stage.load, self.o.seed, **kw)
        stage.plan_info = plan.info
        return plan

    async def _run_stage(self, stage: Stage, http: HttpClient, target: Target) -> None:
        assert self.rundir is not None and self.info is not None
        with self.console.status("planning requests ..."):
            plan = self._plan(stage)
        ok, msg = await reset_prefix_cache(self.info.url, self.o.api_key)
        stage.cache_reset = msg
        if not ok:
            self.warnings.append(
                f"prefix cache not flushed before {stage.label or 'the run'}: {msg}"
            )
        total = len(plan) if isinstance(plan, list) else None
        label = stage.label or (self.o.workload or "trace")
        progress = Progress(self.console, label, total, quiet=self.o.quiet)
        headers = {"Authorization": f"Bearer {self.o.api_key}"} if self.o.api_key else {}
        collector = (
            TimelineCollector(self.info.url, self.rundir, headers) if self.info.timelines else None
        )
        scraper = MetricsScraper(self.info.url, self.rundir, headers, self.o.scrape_interval)

        def on_record(rec: ClientRecord) -> None:
            assert self.rundir is not None
            self.rundir.add_record(rec)
            progress.on_record(rec)
            if collector is not None:
                collector.finished(rec)

        run_tag = self.run_tag + (f"-{len(self.stages)}" if stage.label else "")
        runner: PlanRunner | None = None
        if self.pool is None:
            runner = PlanRunner(
                http,
                target,
                stage.load,
                run_tag=run_tag,
                stage=stage.label,
                on_send=lambda _req: progress.on_send(),
                on_record=on_record,
            )
            # the pool opens before the loop monitor starts, so that no set-up is charged to it
            with self.console.status("opening connections ..."):
                await runner.warm(plan)
        monitor = LoopMonitor()  # with workers, the driver's: informational
        await scraper.start()
        if collector is not None:
            collector.start()
        monitor.start()
        progress.start()
        dist: DistributedStage | None = None
        try:
            if self.pool is not None:
                dist = await self.pool.run_stage(
                    plan,
                    stage.load,
                    run_tag=run_tag,
                    stage=stage.label,
                    on_send=progress.on_send,
                    on_record=on_record,
                )
                stage.result = dist.result
            else:
                assert runner is not None
                stage.result = await runner.run(plan)
        finally:
            await monitor.stop()
            await progress.stop()
            if collector is not None:
                await collector.stop()
            await scraper.stop()
        own = monitor.report(stage.result.records, open_loop=not stage.load.closed)
        stage.health = dist.health if dist is not None else own
        stage.plan_info = {
            **stage.plan_info,
            "scrapes": scraper.scrapes,
            "scrape": scraper.report(own.wall_seconds),
            **({"server_timelines": collector.report()} if collector else {}),
            **({"connections": stage.result.connections} if stage.result.connections else {}),
            "timing_error_budget_s": dist.report["timing_error_budget_s"]
            if dist is not None
            else timing_error_budget(own.loop_lag.get("p99")),
            **({"distributed": {**dist.report, "driver": own.to_dict()}} if dist else {}),
        }
        if scraper.note and not any(scraper.note in w for w in self.warnings):
            self.warnings.append(f"{scraper.note} (the run went on)")
        refusal = target.ids.refusal
        if refusal is not None and refusal not in self.warnings:
            self.warnings.append(refusal)
        if stage.result.interrupted:
            self.interrupted = True
        if stage.result.records:
            try:
                stage.summary = summarize(
                    stage.result.records,
                    slos=self._slos(),
                    warmup=self.o.warmup,
                    cooldown=self.o.cooldown,
                    similarity=self._similarity(runner) if runner is not None else None,
                    slice_duration=self.o.slice_duration,
                    series=self._series(scraper.scrapes),
                )
            except ValueError as e:
                self.warnings.append(f"{stage.label or 'run'}: no summary: {e}")
        if stage.summary:
            self._token_warnings(stage)
        self._figures_warning(stage)

    def _series(self, scrapes: int) -> ServerSeries | None:
        """The stage's ``/metrics`` time series: its last ``scrapes`` rows, read back."""
        assert self.rundir is not None
        path = self.rundir.path / "metrics_scrape.jsonl"
        if scrapes < 2 or not path.exists():
            return None
        rows, _ = read_jsonl(path)
        return server_series(parse_scrapes(rows[-scrapes:]))

    def _similarity(self, runner: PlanRunner) -> dict[str, Any] | None:
        """The ideal prefix reuse of what this stage sent, tokenized after the stage so that
        it costs the event loop nothing while streams run."""
        if self.tokenizer is None or not runner.prompts:
            return None
        chat = self.o.endpoint == "chat"

        def ids(p: str | list[dict[str, str]]) -> list[int]:
            text = self.tokenizer.apply_chat_template(p, add_generation_prompt=True) if chat else p
            return self.tokenizer.encode(text, add_special_tokens=False)

        return ideal_prefix_reuse((cls, ids(p)) for cls, p in runner.prompts)

    def _token_warnings(self, stage: Stage) -> None:
        assert stage.summary is not None
        t = stage.summary["tokens"]
        where = f"{stage.label}: " if stage.label else ""
        # With the server's own tokenizer a differing re-count is text that re-encodes to
        # other tokens, and the server's usage is right: the figures stay in metrics.json.
        if t["usage_vs_client_disagreements"] and not self._servers_tokenizer():
            self.warnings.append(
                f"{where}{t['usage_vs_client_disagreements']} of {t['recounted']} requests: the "
                "server's usage and the client's re-count of output tokens differ (see metrics.json "
                "tokens). A different --tokenizer than the server's gives this; so does, with the "
                "same one, generated text that re-encodes to other tokens. Token counts come from "
                "the server's usage where it sent one"
            )
        if t.get("usage_disputed"):
            ex = t["disputed_examples"][0]
            self.warnings.append(
                f"{where}{t['usage_disputed']} requests: the server's usage claimed output "
                f"tokens its stream cannot have carried (e.g. {ex['usage']} where the client "
                f"counted {ex['counted']}); the client's count is used for them (see "
                'docs/metrics.md, "Token counts")'
            )
        if t["output_length_not_honoured"]:
            self.warnings.append(
                f"{where}{t['output_length_not_honoured']} of {t['output_length_requested']} "
                "requests did not produce the requested output length: the server ignores "
                "min_tokens/ignore_eos, so output lengths follow the model"
            )

    def _servers_tokenizer(self) -> bool:
        """Whether the client re-counts with the tokenizer the server counts with: the
        server's own ``/tokenize``, or a servelab server serving the model the client's
        tokenizer is named after (the embedded engine, launched or not)."""
        if self.tokenizer_source == "server /tokenize":
            return True
        i, name = self.info, self.o.tokenizer or self.o.model
        return i is not None and i.timelines and name is not None and name == i.model_id

    def _figures_warning(self, stage: Stage) -> None:
        """One warning for every request whose per-request server figures were unreadable."""
        assert stage.result is not None
        bad = [
            r.server_timeline["ignored"]
            for r in stage.result.records
            if r.server_timeline and r.server_timeline.get("reported_by") == "ignored"
        ]
        if bad:
            where = f"{stage.label}: " if stage.label else ""
            self.warnings.append(
                f"{where}{len(bad)} request(s) carried per-request server figures that could not "
                f"be read and were ignored (first: {bad[0]}); their TTFT split uses client times"
            )

    def _slos(self) -> dict[str, SLO] | SLO:
        if self.spec is not None:
            return self.spec.class_slos(self.o.slo)
        return self.o.slo or SLO()

    async def _find_max_rate(self, http: HttpClient, target: Target) -> None:
        """Stages at rising (or falling) rates until the goodput fraction crosses the target."""
        slos = self._slos()
        has_slo = (
            any(not s.empty for s in slos.values()) if isinstance(slos, dict) else not slos.empty
        )
        if not has_slo:
            raise ValueError(
                "--find-max-rate needs SLOs: give --slo ttft=2s,itl=250ms or a workload with slo:"
            )

        async def trial(rate: float) -> bool | None:
            stage = Stage(f"rate={rate:.4g}", replace(self.o.load, rate=rate, concurrency=None))
            self.stages.append(stage)
            await self._run_stage(stage, http, target)
            if self.interrupted or self._lost_workers():
                return None
            frac = (stage.summary or {}).get("overall", {}).get("goodput", {}).get("fraction")
            healthy = bool(stage.health and stage.health.valid)
            if saturated(stage.summary):
                self.warnings.append(f"{stage.label}: over-saturated, counted as failing the SLOs")
                return False
            return frac is not None and frac >= self.o.goodput_target and healthy

        result = await find_max_rate(trial, self.o.load.rate or 1.0, self.o.search_steps)
        self.max_rate = {"goodput_target": self.o.goodput_target, **result.to_dict()}

    # ------------------------------------------------------------------ outputs

    def _lost_workers(self) -> bool:
        """A worker was lost: later stages would not run the load they plan, so stop."""
        return self.pool is not None and bool(self.pool.lost)

    def _manifest(self) -> dict[str, Any]:
        o = self.o
        stages = [s for s in self.stages if s.result is not None]
        reasons = [
            f"{s.label + ': ' if s.label else ''}{r}"
            for s in stages
            if s.health
            for r in s.health.reasons
        ]
        recs = [r for s in stages for r in s.result.records]  # type: ignore[union-attr]
        window = None
        summaries = [s.summary for s in stages if s.summary]
        if len(summaries) == 1:
            window = summaries[0]["window"]
        elif recs:
            window = measured_window(recs).to_dict()
        return {
            "name": self.rundir.path.name if self.rundir else None,
            "command": " ".join(o.command),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "versions": versions(),
            "machine": machine(),
            "target_kind": self.info.kind if self.info else None,
            "server": self.info.to_dict() if self.info else None,
            "model": self._request_model() if self.info else o.model,
            "tokenizer": getattr(self.tokenizer, "name", None),
            "tokenizer_source": self.tokenizer_source,
            "config": {
                "endpoint": o.endpoint,
                "seed": o.seed,
                "load": o.load.to_dict(),
                "slo": o.slo.to_dict() if o.slo else None,
                "class_slos": {k: v.to_dict() for k, v in slos.items()}
                if isinstance(slos := self._slos(), dict)
                else None,
                "sweep": {"over": o.sweep[0], "values": o.sweep[1]} if o.sweep else None,
                "find_max_rate": o.find_max_rate,
                "goodput_target": o.goodput_target if o.find_max_rate else None,
                "warmup": o.warmup.describe(),
                "cooldown": o.cooldown.describe(),
                "slice_duration": o.slice_duration,
                "timeout_s": o.timeout,
                "strict_openai": o.strict_openai,
                "request_id_header": self.request_ids.describe() if self.request_ids else None,
                # cold: set-up inside TTFT; warm: opened before each stage's clock (its plan's
                # "connections" says how many and how long)
                "connections": "cold" if o.cold_connections else "warm",
                "sampling": o.sampling,
                "datasets": self._dataset_pins(),
                "run_tag": self.run_tag,
                "chunk_timestamps": self.stamping,
            },
            "workload": self.spec.model_dump() if self.spec else {"trace": o.load.trace},
            "stages": [
                {
                    "label": s.label,
                    "load": s.load.to_dict(),
                    "start": s.result.start,  # type: ignore[union-attr]
                    "end": s.result.end,  # type: ignore[union-attr]
                    "sent": s.result.sent,  # type: ignore[union-attr]
                    "records": len(s.result.records),  # type: ignore[union-attr]
                    "prefix_cache": s.cache_reset,
                    "plan": s.plan_info,
                    "client": s.health.to_dict() if s.health else None,
                }
                for s in stages
            ],
            "window": window,
            "max_rate": self.max_rate,
            "interrupted": self.interrupted,
            "workers": self.pool.describe() if self.pool else None,
            "complete": not self._lost_workers(),
            "timing_error_budget_s": max(
                (s.plan_info["timing_error_budget_s"] for s in stages if s.health),
                key=lambda b: b["across_workers_s"],
                default=None,
            ),
            "valid": not reasons,
            "invalid_reason": "; ".join(reasons) if reasons else None,
            "warnings": self.warnings,
            "simulated": False,
        }

    def _dataset_pins(self) -> dict[str, Any] | None:
        """Per dataset class: the file's pin, the selection, the filters (first stage's plan)."""
        for st in self.stages:
            if "datasets" in st.plan_info:
                return st.plan_info["datasets"]
        return None

    def _metrics(self) -> dict[str, Any]:
        stages = [s for s in self.stages if s.result is not None]
        if len(stages) == 1 and stages[0].label is None:
            body = dict(stages[0].summary or {})
            body["client"] = stages[0].health.to_dict() if stages[0].health else None
            return body
        return {
            "stages": [
                {
                    "label": s.label,
                    "load": s.load.to_dict(),
                    "metrics": s.summary,
                    "client": s.health.to_dict() if s.health else None,
                }
                for s in stages
            ],
            "max_rate": self.max_rate,
        }

    def _print(self, manifest: dict[str, Any]) -> None:
        c = self.console
        shown = [s for s in self.stages if s.summary]
        if len(shown) == 1 and shown[0].label is None:
            s = shown[0].summary
            assert s is not None
            w = s["window"]
            table = summary_table(
                f"latency (measured window {w['duration_s']:.1f}s, "
                f"warm-up {w['warmup']}, cool-down {w['cooldown']})",
                s,
            )
            c.print(fit(table, c, ["p90", "max", "p95", "mean"]))
            c.print(fit(rates_table(s), c, ["failed", "in tok/s", "goodput req/s"]))
            c.print(similarity_line(s))
            print_timeslices(s, c)
        elif shown:
            c.print(
                stages_table(
                    [(s.label, s.summary, bool(s.health and s.health.valid)) for s in shown]
                )
            )
        if self.max_rate:
            best = self.max_rate["max_rate"]
            c.print(
                f"[bold]max rate meeting SLOs for {self.o.goodput_target:.0%} of requests: "
                f"{'none found' if best is None else f'{best:.3g} req/s'}[/bold]"
            )
        if self.pool is not None:
            from servelab.bench.distributed.driver import report_line

            for st in self.stages:
                if "distributed" in st.plan_info:
                    where = f"{st.label}: " if st.label else ""
                    c.print(f"workers: {where}{report_line(st.plan_info['distributed'])}")
        for w in self.warnings:
            c.print(f"[yellow]warning:[/yellow] {w}")
        if not manifest["valid"]:
            c.print(f"[bold red]INVALID RUN:[/bold red] {manifest['invalid_reason']}")
        if self.interrupted:
            c.print("[yellow]interrupted: the records so far are saved[/yellow]")
        if self.rundir is not None:
            c.print(f"run directory: {self.rundir.path}")

    # ------------------------------------------------------------------ main

    async def run(self) -> int:
        o = self.o
        o.validate()
        self._plan_inputs()  # bad workloads fail before a server is started
        self.rundir = RunDir(self._out_dir(), overwrite=o.overwrite)
        try:
            await self._target()
            assert self.info is not None
            if self.tokenizer is None:
                self._server_tokenizer()
            if not o.quiet:
                for line in self._tokenizer_lines():
                    self.console.print(line, highlight=False)
            target = Target(
                url=self.info.url,
                model=self._request_model(),
                endpoint=o.endpoint,
                api_key=o.api_key,
                strict_openai=o.strict_openai,
                timeout=o.timeout,
                # the server's /tokenize is not asked to re-count while it serves the run
                tokenizer=None if isinstance(self.tokenizer, ServerTokenizer) else self.tokenizer,
                extra_body=o.sampling,
                request_id_header=o.request_id_header,
                cold_connections=o.cold_connections,
            )
            self.request_ids = target.ids
            http = HttpClient(self.info.url)
            # Whatever the calling process holds (a demo or matrix keeps earlier runs loaded)
            # stays out of the collector's full passes while requests stream: a demo sub-run
            # saw its loop held 131 ms at 4% client CPU, most likely by such a pass.
            gc.collect()
            gc.freeze()
            try:
                if o.distributed:
                    self.pool = await self._start_workers(target)
                if o.find_max_rate:
                    await self._find_max_rate(http, target)
                else:
                    for i, stage in enumerate(_stages(o)):
                        self.stages.append(stage)
                        await self._run_stage(stage, http, target)
                        if self.interrupted or self._lost_workers():
                            break
                        if o.sweep and (why := sweep_stop(*o.sweep, i, stage.summary)):
                            self.warnings.append(why)
                            break
            finally:
                gc.unfreeze()
                if target.streams_past_done:
                    self.warnings.append(
                        f"{target.streams_past_done} stream(s) sent data events after "
                        "data: [DONE]; a stream ends at [DONE], so they were ignored"
                    )
                self.stamping = http.stamping
                await http.close()
                if self.pool is not None:
                    self.stamping = self.pool.stamping
                    await self.pool.close()
        finally:
            manifest = self._manifest()
            self.rundir.write_manifest(manifest)
            if any(s.result for s in self.stages):
                self.rundir.write_json("metrics.json", self._metrics())
            self.rundir.close()
            if self.launched is not None:
                with self.console.status("stopping servelab serve ..."):
                    self.launched.stop()
        self._print(manifest)
        if self.interrupted:
            return 130
        return 0 if manifest["valid"] else 3


def run_bench(opts: BenchOptions, console: Console | None = None) -> int:
    """Run the benchmark; returns the exit code (0 ok, 3 invalid run, 130 interrupted)."""
    if console is None:
        console = Console()
        if not console.is_terminal:  # logs and pipes: wide enough for the tables
            console = Console(width=140)
    bench = Bench(opts, console)
    try:
        return run_loop(bench.run())
    except KeyboardInterrupt:
        return 130
    finally:
        sys.stdout.flush()
