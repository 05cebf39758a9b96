"""`servelab profile`: measure the real engine's step times on this machine over a grid
(or build the table from real runs' steps): ``ProfileSpec`` and ``run_profile``.

The engine is the real one (``LLMEngine`` over ``TorchModelRunner``, the thread count a
server would use). Each grid point is a batch shape -- prefill chunks after some cached
context, decodes at some context length, or a mix -- run as a ``BatchPlan`` straight on
the runner, once to warm up and then ``repeats`` times; the median time is kept. Every
sequence of a shape gets blocks of its own from the engine's KV-cache manager, as in a
real batch: when sequences shared one block table, their K/V reads hit the CPU caches and
batched decode at long context came out too fast (docs/design/sim.md). Shapes whose contexts
the KV pool cannot hold at once are left out of the grid (the engine could not run them
either), and the table lists them.

The engine's own work around each step (scheduling, stop rules, detokenization) is
measured on a short real run through ``engine.step()`` and fitted as ``per_step +
per_seq * seqs`` (``sim.fit.run_profile.fit_overhead``); the profiled cost model adds it to
every step. A workflow, since it loads the torch runtime; the simulator reads only the table
it writes (``sim.costs.profiled``).
"""

from __future__ import annotations

import dataclasses
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

from servelab.engine.batch_plan import BatchPlan, ScheduledSeq
from servelab.engine.engine_config import EngineConfig
from servelab.engine.sampling_params import SamplingParams
from servelab.sim.costs.profiled import ProfileSample, ProfileTable
from servelab.sim.costs.work import StepWork
from servelab.sim.fit.run_profile import fit_overhead
from servelab.vocab import DEFAULT_MODEL

# The model package (torch, 6 s to import) is imported only by the functions that run the
# engine, so that the grid and the shapes serve tools that never load a model.

# A shape: the (new tokens, cached context before them) of every sequence in the step.
Shape = list[tuple[int, int]]


def grid(kind: str = "default") -> list[Shape]:
    """Batch shapes to profile. ``quick`` is a handful (tests, smoke runs)."""
    if kind == "quick":
        return [
            [(1, 64)], [(1, 64)] * 4, [(1, 512)] * 4, [(1, 64)] * 16,
            [(32, 0)], [(128, 0)], [(128, 256)], [(64, 0), (1, 128), (1, 128)],
        ]  # fmt: skip
    if kind != "default":
        raise ValueError(f"unknown profile grid {kind!r}; use default or quick")
    shapes: list[Shape] = []
    for d in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64):
        for ctx in (64, 512, 1536):
            shapes.append([(1, ctx)] * d)
    for p in (8, 16, 32, 64, 128, 256, 512, 1024, 2048):
        for prefix in (0, 1024):
            shapes.append([(p, prefix)])
    for p in (64, 256, 1024):
        for d in (4, 16):
            shapes.append([(p, 0)] + [(1, 512)] * d)
    return shapes


def work_of_shape(shape: Shape) -> StepWork:
    w = StepWork()
    for n, ctx in shape:
        w.add(n, ctx, 1)
    return w


def _plan(shape: Shape, block_tables: list[list[int]], step_id: int) -> BatchPlan:
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    seqs = [
        ScheduledSeq(
            request_id=f"p{i}",
            token_ids=[(17 + 31 * (i + j)) % 20000 + 1 for j in range(n)],
            start_pos=ctx,
            block_table=table,
            sample=True,
            sampling=sp,
        )
        for i, ((n, ctx), table) in enumerate(zip(shape, block_tables, strict=True))
    ]
    return BatchPlan(step_id, seqs)


def blocks_needed(shape: Shape, block_size: int) -> int:
    """KV blocks the shape holds at once: each sequence's context plus its new tokens."""
    return sum(-(-(n + ctx) // block_size) for n, ctx in shape)


def fitting_shapes(engine: Any, shapes: list[Shape]) -> tuple[list[Shape], list[Shape]]:
    """``(shapes the engine's idle KV pool and context limit hold, the others)``."""
    free = engine.kv_cache.num_free_blocks
    bs, limit = engine.config.block_size, engine.config.max_model_len
    keep: list[Shape] = []
    drop: list[Shape] = []
    for shape in shapes:
        ok = blocks_needed(shape, bs) <= free and max(n + c for n, c in shape) <= limit
        (keep if ok else drop).append(shape)
    return keep, drop


def measure_shapes(
    engine: Any,
    shapes: list[Shape],
    repeats: int = 2,
    progress: Callable[[int, int, Shape, float], None] | None = None,
) -> list[ProfileSample]:
    """Median executor time of each shape (see the module docstring)."""
    kv = engine.kv_cache
    runner = engine.executor
    _, too_big = fitting_shapes(engine, shapes)
    if too_big:
        raise ValueError(
            f"profile shape {too_big[0]} needs {blocks_needed(too_big[0], engine.config.block_size)} "
            f"KV blocks or a longer context than the engine holds ({kv.num_free_blocks} free "
            f"blocks, max_model_len {engine.config.max_model_len}); raise kv_cache_memory_gb "
            "or drop the shape"
        )
    samples = []
    for k, shape in enumerate(shapes):
        names = [f"servelab-profile-{i}" for i in range(len(shape))]
        tables = []
        try:
            for name, (n, ctx) in zip(names, shape, strict=True):
                if not kv.allocate(name, n + ctx):
                    raise RuntimeError("the KV pool is in use; profile on an idle engine")
                tables.append(list(kv.block_table(name)))
            times = []
            for r in range(repeats + 1):
                out = runner.execute(_plan(shape, tables, k * (repeats + 1) + r))
                if r:  # the first run warms caches and allocators
                    times.append(out.elapsed)
        finally:
            for name in names:
                kv.free(name)
        t = statistics.median(times)
        samples.append(ProfileSample(work_of_shape(shape), t, repeats))
        if progress is not None:
            progress(k + 1, len(shapes), shape, t)
    return samples


def measure_engine_overhead(
    engine: Any, requests: int = 6, prompt: int = 48, output: int = 24
) -> dict[str, float]:
    """Per-step engine time outside the executor on a short real run: ``per_step + per_seq * seqs``."""
    runner = engine.executor
    spent: list[float] = []
    real_execute = runner.execute

    def timed(plan: BatchPlan):
        out = real_execute(plan)
        spent.append(out.elapsed)
        return out

    runner.execute = timed
    rows: list[tuple[int, float]] = []
    try:
        sp = SamplingParams(max_tokens=output, ignore_eos=True, temperature=0.0)
        for i in range(requests):
            ids = [(i * 97 + j * 13) % 20000 + 1 for j in range(prompt + 8 * i)]
            engine.add_request(f"servelab-overhead-{i}", prompt_token_ids=ids, sampling_params=sp)
        while engine.has_unfinished():
            n_before = len(spent)
            t0 = time.perf_counter()
            res = engine.step()
            wall = time.perf_counter() - t0
            if res.record is not None and len(spent) > n_before:
                seqs = res.record.decode_seqs + len(res.record.prefill)
                rows.append((seqs, max(wall - spent[-1], 0.0)))
    finally:
        runner.execute = real_execute
        engine.reset_prefix_cache()
    return fit_overhead(rows)


def profile_engine(
    engine: Any,
    shapes: list[Shape],
    repeats: int = 2,
    progress: Callable[[int, int, Shape, float], None] | None = None,
    label: str = "custom",
    model: str = DEFAULT_MODEL,
) -> ProfileTable:
    """Profile an already built real engine over ``shapes``; the table records what the
    simulator needs to size its KV pool and context exactly like this engine."""
    import torch

    from servelab.model import cpu_kernels, kernel_build

    runner = engine.executor
    bs = engine.config.block_size
    shapes, too_big = fitting_shapes(engine, shapes)
    samples = measure_shapes(engine, shapes, repeats, progress)
    overhead = measure_engine_overhead(engine)
    meta = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "grid": label,
        "repeats": repeats,
        "threads": runner.num_threads,
        "torch": torch.__version__,
        "machine": {
            "host": platform.node(),
            "processor": platform.processor() or platform.machine(),
        },
        "kv_bytes_per_token": runner.kv_block_bytes(bs) / bs,
        "max_model_len": runner.max_model_len,
        "eos_token_ids": list(runner.eos_token_ids),
        "engine_config": dataclasses.asdict(engine.config),
        "quantization": runner.loaded.quantization,
        "cpu_kernels": kernel_build.isa() if cpu_kernels.available() else "",
        "overhead": overhead,
        "shapes_left_out": too_big,
    }
    return ProfileTable(model=model, device=str(runner.device), samples=samples, meta=meta)


def profile(
    model: str = DEFAULT_MODEL,
    config: EngineConfig | None = None,
    grid_kind: str = "default",
    repeats: int = 2,
    device: str | None = None,
    threads: int | None = None,
    progress: Callable[[int, int, Shape, float], None] | None = None,
    quantization: str = "none",
) -> ProfileTable:
    """Load ``model`` into the real engine (weights in ``quantization`` mode) and profile
    it over ``grid(grid_kind)``."""
    from servelab.engine.engine_config import default_threads
    from servelab.model.build import build_engine

    shapes = grid(grid_kind)
    engine = build_engine(
        model,
        config or EngineConfig(),
        device,
        threads or default_threads(),
        quantization=quantization,
    )
    return profile_engine(engine, shapes, repeats, progress, grid_kind, model)


@dataclasses.dataclass(frozen=True)
class ProfileSpec:
    """One `servelab profile` run: ``model`` in ``quantization`` mode over ``grid`` (each
    shape ``repeats`` times, with ``threads`` on ``device``, the engine set by
    ``engine_args`` in `servelab serve`'s spelling), or the table of the ``from_runs``' steps;
    written to ``out``."""

    model: str = DEFAULT_MODEL
    out: str = "profile.json"
    grid: str = "default"
    repeats: int = 2
    threads: int | None = None
    device: str | None = None
    engine_args: str | None = None
    from_runs: tuple[str, ...] = ()
    quantization: str = "none"


def run_profile(spec: ProfileSpec, say: Callable[[str], None]) -> None:
    """Measure (or build) the table ``spec`` asks for, write it and ``say`` what it holds,
    one line per profiled shape as it goes. Raises ValueError naming the flag to fix."""
    from servelab.sim.costs.profiled import ProfiledCostModel
    from servelab.sim.engine_args import parse_engine_args, split_deployment
    from servelab.sim.fit.run_profile import table_from_runs
    from servelab.vocab import check_quantization

    check_quantization(spec.quantization)
    eng, _ = split_deployment(parse_engine_args(spec.engine_args))
    if spec.from_runs and spec.quantization != "none":
        raise ValueError(
            "--from-run takes the weights' mode from the runs' servers; drop --quantization"
        )
    if spec.from_runs:
        table = table_from_runs(list(spec.from_runs), spec.model)
    elif spec.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    else:

        def show(k: int, n: int, shape: Shape, t: float) -> None:
            say(f"[{k}/{n}] {_shape_text(shape)}: {t * 1000:.1f} ms")

        table = profile(
            spec.model, EngineConfig(**eng), spec.grid, spec.repeats, spec.device,
            spec.threads, show, spec.quantization,
        )  # fmt: skip
    fitted = ProfiledCostModel(table)
    table.save(spec.out)
    _describe(table, spec.out, fitted.fit_error, say)


def _shape_text(shape: Shape) -> str:
    """A shape's prefills (tokens@context) and decodes."""
    pre = [f"{a}@{c}" for a, c in shape if a > 1]
    dec = [c for a, c in shape if a == 1]
    return " + ".join(
        ([f"prefill {'+'.join(pre)}"] if pre else [])
        + ([f"decode {len(dec)} @ctx {max(dec)}"] if dec else [])
    )


def _describe(table: ProfileTable, out: str, fit_error: float, say: Callable[[str], None]) -> None:
    if table.meta.get("shapes_left_out"):
        say(
            f"left out {len(table.meta['shapes_left_out'])} shapes whose contexts the KV pool "
            "cannot hold at once (listed in the table's meta.shapes_left_out)"
        )
    if table.meta.get("run_speeds"):
        speeds = ", ".join(f"{f:.2f}" for f in table.meta["run_speeds"])
        say(
            f"the runs' speeds on one-sequence decodes: {speeds} of their mean (machine "
            "drift; the profile prices their mean; meta.run_speeds)"
        )
    say(
        f"wrote {out}: {len(table.samples)} steps of {table.meta.get('quantization', 'none')} "
        "weights, interpolation error median "
        f"{fit_error:.1%}; use it with `servelab sim --profile {out}`"
    )
