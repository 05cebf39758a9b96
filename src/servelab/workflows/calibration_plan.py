"""`servelab calibrate --plan`: a short ladder of benchmark runs against a live server that
spans what will be predicted, and the twin (``sim.fit.twin``) fitted to all of them.

A twin fitted to one chat run prices a prompt token at what chat prompts cost; a server whose
prefill cost grows faster than linearly with a step's tokens is priced low on long prompts
(vLLM-CPU's RAG TTFT p90 -37% to -48%, docs/design/twin.md). The ladder shows the fit each
cost on its own:

- **prefill**: one request at a time at prompt lengths doubling from 64 (from a quarter of
  ``max_prompt`` when it is under 256) up to ``max_prompt``, each ``PREFILL_REPEATS`` times
  with ``PREFILL_OUTPUT``-token answers: a prompt's cost against its length with nothing
  beside it, so the fit's attention-pair price sees the growth with context;
- **decode**: closed loops at each of ``concurrency`` streams, two requests per stream of
  short prompts and ``DECODE_OUTPUT``-token answers: a decode's price per sequence;
- **long decode**: up to ``LONG_DECODE_STREAMS`` streams decoding at once after prompts of
  half ``max_prompt``: the price of reading a long context, which a decode pays per cached
  token (the short decodes cannot show it, and the prefill rungs' few decodes run alone);
- **prefix**: ``PREFIX_REQUESTS`` requests one at a time sharing a prefix of half
  ``max_prompt``: the first computes it, the others find it in the prefix cache (where the
  server has one), so cached and computed prompt tokens are told apart.

Each rung is one `servelab bench` run (``bench.run.run_bench``: its own run directory, the
server's prefix cache flushed before it where the server allows it). A warm-up run at the
longest prompt goes first (a server's first long prompt is often slow, and it checks that the
server takes it); its times give the plan's expected duration and it is not fitted. The twin
is then fitted to the rungs' runs together (``sim.fit.held_out.calibrate_twin``, the path of
`servelab calibrate RUN RUN...`), so its recorded domain spans the ladder.
"""

from __future__ import annotations

import io
import json
import math
import shlex
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from servelab.rundir import Run
    from servelab.sim.fit.twin import TwinCalibration

DEFAULT_MAX_PROMPT = 2048
LOWEST_MAX_PROMPT = 16
LADDER_START = 64  # the shortest prompt of the prefill ladder (a quarter of a shorter top)
PREFILL_OUTPUT = 8
PREFILL_REPEATS = 2
DECODE_PROMPT = 64
DECODE_OUTPUT = 64
DECODE_REQUESTS_PER_STREAM = 2
LONG_DECODE_STREAMS = 4  # enough streams for the read to grow with the batch, few enough for slots
PREFIX_REQUESTS = 4
WARMUP_REQUESTS = 2
WARMUP_OUTPUT = 16
CONTEXT_MARGIN = 16  # tokens kept free below the server's context for markup and a BOS
TWIN_FILE = "twin.json"
DOMAIN_SHOWN = ("prompt_tokens", "output_tokens", "in_flight")  # the figures sim checks


@dataclass(frozen=True)
class CalibrationPlanSpec:
    """The server (``url``, ``model``: the served model, default the one it lists;
    ``api_key``), the ladder's longest prompt (``max_prompt``, None: ``DEFAULT_MAX_PROMPT``
    capped by the server's context) and its stream counts (``concurrency``), the server's
    stated launch command (``server_config``), the catalogue entry of its hardware, and
    ``out``, the directory of the ladder's runs and its twin (None: runs/calibrate-STAMP)."""

    url: str | None
    model: str | None = None
    max_prompt: int | None = None
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    out: str | None = None
    server_config: str | None = None
    hardware: str | None = None
    api_key: str | None = None

    def validate(self) -> None:
        """ValueError naming the flag to fix."""
        if not self.url:
            raise ValueError("--plan measures a live server: give its --url")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url {self.url!r}: give a base URL such as http://127.0.0.1:8000")
        if self.max_prompt is not None and self.max_prompt < LOWEST_MAX_PROMPT:
            raise ValueError(
                f"--max-prompt {self.max_prompt}: give {LOWEST_MAX_PROMPT} tokens or more "
                "(the longest prompt you will predict)"
            )
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("--concurrency: give stream counts of 1 or more, e.g. 1,2,4,8")


@dataclass(frozen=True)
class Rung:
    """One bench run of the ladder: ``requests`` requests by ``concurrency`` streams, each a
    prompt of ``prompt`` tokens (the first ``shared`` of them one prefix for all) and an
    answer of ``output`` tokens."""

    name: str
    kind: str  # prefill, decode, prefix, warmup
    prompt: int
    output: int
    concurrency: int
    requests: int
    shared: int = 0

    def workload(self) -> dict[str, Any]:
        """The rung as a workload spec (``bench.workloads.spec``)."""
        cls: dict[str, Any] = {
            "name": self.kind,
            "input": self.prompt - self.shared,
            "output": self.output,
        }
        if self.shared:
            cls["prefix"] = [{"name": "shared", "count": 1, "tokens": self.shared, "reuse": 1.0}]
        return {"name": f"calibrate-{self.name}", "classes": [cls]}

    def seconds(self, per_prompt_token: float, per_token: float, overhead: float) -> float:
        """About how long the rung runs at the warm-up's prices (its waves one after another;
        a step of several streams costs more than one stream's, which this leaves out)."""
        waves = math.ceil(self.requests / self.concurrency)
        each = (self.prompt - self.shared) * per_prompt_token + self.output * per_token
        return overhead + waves * each


def top_prompt(max_prompt: int | None, max_model_len: int | None) -> tuple[int, str | None]:
    """The ladder's longest prompt and, when the server's context cut it, a line saying so."""
    want = max_prompt or DEFAULT_MAX_PROMPT
    if max_model_len is None:
        return want, None
    room = max_model_len - PREFILL_OUTPUT - CONTEXT_MARGIN
    if want <= room:
        return want, None
    if room < LOWEST_MAX_PROMPT:
        raise ValueError(f"the server's context ({max_model_len} tokens) is too short to probe")
    said = f"--max-prompt {max_prompt}" if max_prompt else f"the default {DEFAULT_MAX_PROMPT}"
    return room, f"{said} is capped at {room} tokens: the server's context is {max_model_len}"


def ladder(max_prompt: int, concurrency: tuple[int, ...]) -> list[Rung]:
    """The rungs for a longest prompt of ``max_prompt`` tokens (module doc), warm-up first."""
    start = LADDER_START if max_prompt >= 4 * LADDER_START else max(4, max_prompt // 4)
    lengths = []
    n = start
    while n < max_prompt:
        lengths.append(n)
        n *= 2
    lengths.append(max_prompt)
    short = min(DECODE_PROMPT, start)
    rungs = [Rung("warmup", "warmup", max_prompt, WARMUP_OUTPUT, 1, WARMUP_REQUESTS)]
    rungs += [
        Rung(f"prefill-{n}", "prefill", n, PREFILL_OUTPUT, 1, PREFILL_REPEATS) for n in lengths
    ]
    rungs += [
        Rung(f"decode-c{c}", "decode", short, DECODE_OUTPUT, c, DECODE_REQUESTS_PER_STREAM * c)
        for c in sorted(set(concurrency))
    ]
    shared = max_prompt // 2  # the long decodes' prompts and the prefix rung's shared part
    streams = max((c for c in concurrency if c <= LONG_DECODE_STREAMS), default=min(concurrency))
    rungs.append(Rung(f"decode-long-c{streams}", "decode", shared, DECODE_OUTPUT, streams, streams))
    rungs.append(
        Rung("prefix", "prefix", shared + start, PREFILL_OUTPUT, 1, PREFIX_REQUESTS, shared)
    )
    return rungs


def _bench(spec: CalibrationPlanSpec, rung: Rung, out: Path, seed: int) -> Path:
    """Run one rung as `servelab bench` planned from ``seed`` (each rung its own, so that no
    rung's prompts begin as another's and hit the prefix cache where the server keeps it
    across the flush the bench asks for); its run directory. ValueError when cut off."""
    from rich.console import Console

    from servelab.bench.run import BenchOptions, run_bench
    from servelab.bench.workloads.request_plan import LoadSpec

    workload = out / "workloads" / f"{rung.name}.json"
    workload.parent.mkdir(parents=True, exist_ok=True)
    workload.write_text(json.dumps(rung.workload(), indent=1))
    opts = BenchOptions(
        url=spec.url,
        model=spec.model,
        api_key=spec.api_key,
        workload=str(workload),
        load=LoadSpec(concurrency=rung.concurrency, requests=rung.requests),
        out=out / rung.name,
        server_config=spec.server_config,
        seed=seed,
        quiet=True,
        overwrite=True,
        command=["servelab", "calibrate", "--plan", f"({rung.name})"],
    )
    code = run_bench(opts, Console(file=io.StringIO(), width=100))
    if code == 130:
        raise ValueError(f"interrupted during {rung.name}; the runs so far are in {out}")
    return out / rung.name


def _prices(run: Run, rung: Rung, wall: float) -> tuple[float, float, float]:
    """(seconds per prompt token, per answer token, the bench's own time per run) from the
    warm-up run that took ``wall`` seconds: its TTFT spread over the prompt, its ITL, its
    time outside the requests."""
    import statistics

    done = [r for r in run.records if r.ok and r.ttft is not None and r.done is not None]
    if not done:
        raise ValueError(f"the warm-up at {rung.prompt} prompt tokens failed: see {run.path}")
    ttft = statistics.median(r.ttft for r in done if r.ttft is not None)
    gaps = [g for r in done for g in r.itls]
    itl = statistics.median(gaps) if gaps else ttft / rung.prompt
    busy = sum(r.done - r.actual_send for r in done if r.done is not None)
    return ttft / rung.prompt, itl, max(0.0, wall - busy)


def prompt_price(cal: TwinCalibration, prompt: int) -> tuple[float, float]:
    """What the twin says a prompt of ``prompt`` tokens alone takes to its first token (its
    chunks of the twin's token budget, each after the ones before, and the API's time), and
    the seconds of that priced on attention pairs: how fast the cost grows with length."""
    from servelab.sim.costs.work import StepWork
    from servelab.sim.fit.twin import TwinCostModel

    model = TwinCostModel(cal.cost)
    budget = max(1, int(cal.engine_config.get("max_num_batched_tokens") or prompt))
    total, attn, done = cal.api_overhead_s, 0.0, 0
    while done < prompt:
        w = StepWork()
        n = min(budget, prompt - done)
        w.add(n, done, 1 if done + n == prompt else 0)
        total += model.predict(w)
        attn += cal.cost["attn_pairs"] * w.attn_pairs
        done += n
    return total, attn


def _prefill_check(
    cal: TwinCalibration, runs: list[tuple[Rung, Run]]
) -> list[tuple[int, float | None, float, float]]:
    """Each prefill rung's prompt, measured TTFT p50 and the twin's price of it."""
    import statistics

    rows = []
    for rung, run in runs:
        if rung.kind != "prefill":
            continue
        ttfts = [r.ttft for r in run.records if r.ok and r.ttft is not None]
        priced, attn = prompt_price(cal, rung.prompt)
        rows.append((rung.prompt, statistics.median(ttfts) if ttfts else None, priced, attn))
    return rows


def run_calibration_plan(spec: CalibrationPlanSpec, console: Console) -> TwinCalibration:
    """State the ladder and its expected duration, run it against ``spec.url`` with a line
    per rung, fit the twin to its runs, write ``out/twin.json`` and say what it found.
    ValueError (or ``RunDirError``) naming what to fix."""
    from servelab.bench.client.event_loop import run_loop
    from servelab.bench.manifest import redact
    from servelab.bench.servers.target import probe
    from servelab.report.ladder_tables import ladder_table, prefill_check_table
    from servelab.report.twin_tables import calibration_table
    from servelab.rundir import load_run
    from servelab.sim.fit.held_out import calibrate_twin
    from servelab.sim.run import say

    spec.validate()
    assert spec.url is not None
    url = spec.url.rstrip("/")
    info = run_loop(probe(url, spec.api_key))
    top, note = top_prompt(spec.max_prompt, info.max_model_len)
    rungs = ladder(top, spec.concurrency)
    out = Path(spec.out or f"runs/calibrate-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(
        json.dumps({"url": url, "rungs": [asdict(r) for r in rungs]}, indent=1)
    )
    console.print(ladder_table([asdict(r) for r in rungs], note))

    began = time.monotonic()
    warmup, *fitted = rungs
    with console.status(f"warm-up: {warmup.requests} requests of {warmup.prompt} tokens ..."):
        warm = load_run(_bench(spec, warmup, out, seed=0))
    per_prompt, per_token, overhead = _prices(warm, warmup, time.monotonic() - began)
    expected = sum(r.seconds(per_prompt, per_token, overhead) for r in fitted)
    say(
        console,
        f"warm-up: {per_prompt * warmup.prompt * 1e3:.0f} ms to a first token at "
        f"{warmup.prompt} prompt tokens, {per_token * 1e3:.1f} ms a token after it",
    )
    say(console, f"the ladder should take about {expected:.0f} s at that speed")

    runs: list[tuple[Rung, Run]] = []
    for i, rung in enumerate(fitted, 1):
        t0 = time.monotonic()
        with console.status(f"[{i}/{len(fitted)}] {rung.name} ..."):
            run = load_run(_bench(spec, rung, out, seed=i))
        runs.append((rung, run))
        ok = sum(r.ok for r in run.records)
        ttfts = sorted(r.ttft for r in run.records if r.ok and r.ttft is not None)
        median = f", TTFT p50 {ttfts[len(ttfts) // 2] * 1e3:.0f} ms" if ttfts else ""
        say(
            console,
            f"[{i}/{len(fitted)}] {rung.name}: {ok}/{len(run.records)} ok in "
            f"{time.monotonic() - t0:.1f} s{median}",
        )
        if not run.valid:  # kept: the fit's noise and spreads carry a loaded host
            say(console, f"    marked invalid: {str(run.invalid_reason).split(':')[0]}")
    say(console, f"ladder done in {time.monotonic() - began:.0f} s (expected {expected:.0f} s)")

    stated = shlex.join(redact(shlex.split(spec.server_config))) if spec.server_config else None
    cal = calibrate_twin([run for _, run in runs], stated, spec.hardware, spec.model)
    twin = out / TWIN_FILE
    cal.save(twin)
    console.print(calibration_table(asdict(cal)))
    console.print(prefill_check_table(_prefill_check(cal, runs)))
    dom = cal.domain or {}
    say(
        console,
        "domain: "
        + ", ".join(f"{k} {lo}-{hi}" for k, (lo, hi) in dom.items() if k in DOMAIN_SHOWN),
    )
    say(console, f"wrote {twin} (the runs beside it); predict with")
    say(console, f"  servelab sim --calibration {twin} --workload W --rate R --seeds 8")
    return cal
