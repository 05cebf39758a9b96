"""`servelab bench`'s flags -> the ``BenchOptions`` it runs: the parsers of its own flags'
values and the one place the record becomes options (``BenchOptions.validate`` and
``LoadSpec.from_flags`` hold the rules)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from servelab.cli.errors import bad_flag, fail, seconds

if TYPE_CHECKING:
    from servelab.bench.run import BenchOptions
    from servelab.bench.workloads.spec import DatasetSource
    from servelab.cli.bench import BenchFlags


def parse_output_len(text: str) -> str | int:
    """``dataset``, ``natural`` or a number of tokens."""
    if text in ("dataset", "natural"):
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise bad_flag(
            "--output-len", f"{text!r}: give dataset, natural or a number of tokens >= 1"
        )
    return n


def parse_extra_body(text: str | None) -> dict[str, object]:
    """A JSON object merged into every request body."""
    if text is None:
        return {}
    import json

    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad_flag("--extra-body", f"not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(body, dict):
        raise bad_flag("--extra-body", "give a JSON object, e.g. '{\"seed\": 1}'")
    return body


def parse_sweep(text: str) -> tuple[str, list[float]]:
    """``"rate=0.5,1,2"`` or ``"concurrency=1,4,16"`` -> (kind, values)."""
    kind, sep, values = text.partition("=")
    kind = kind.strip()
    hint = "write --sweep rate=0.5,1,2 or --sweep concurrency=1,4,16"
    if not sep or kind not in ("rate", "concurrency"):
        raise bad_flag("--sweep", f"{text!r}: {hint}")
    try:
        vals = [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise bad_flag("--sweep", f"{text!r}: values must be numbers; {hint}") from None
    if not vals or any(not v > 0 for v in vals):
        raise bad_flag("--sweep", f"{text!r}: give one or more values > 0; {hint}")
    if kind == "concurrency" and any(v != int(v) for v in vals):
        raise bad_flag("--sweep", f"{text!r}: concurrency values must be whole numbers")
    return kind, vals


def bench_options(flags: BenchFlags) -> BenchOptions:
    """The run that `servelab bench`'s parsed ``flags`` ask for, validated.

    Raises typer's BadParameter for a flag it cannot read, ValueError for options that
    do not go together.
    """
    from servelab.bench.manifest import redact
    from servelab.bench.run import BenchOptions
    from servelab.units import SLO, Trim

    sweep = parse_sweep(flags.sweep) if flags.sweep else None
    opts = BenchOptions(
        url=flags.url,
        model=flags.model,
        tokenizer=flags.tokenizer,
        api_key=flags.api_key or None,
        workload=flags.load.workload,
        load=flags.load.load_spec(sweep, search=flags.find_max_rate),
        slo=SLO.parse(flags.load.slo) if flags.load.slo else None,
        sweep=sweep,
        find_max_rate=flags.find_max_rate,
        goodput_target=flags.goodput_target,
        search_steps=flags.search_steps,
        out=Path(flags.out) if flags.out else None,
        engine_args=flags.engine_args,
        server_config=flags.server_config,
        seed=flags.load.seed,
        endpoint=flags.load.endpoint,
        warmup=Trim.parse(flags.warmup),
        cooldown=Trim.parse(flags.cooldown),
        quiet=flags.quiet,
        strict_openai=flags.strict_openai,
        request_id_header=not flags.no_request_id_header,
        cold_connections=flags.cold_connections,
        timeout=seconds("--timeout", flags.timeout) or 600.0,
        command=redact(["servelab", *sys.argv[1:]]),
        overwrite=flags.overwrite,
        workers=flags.workers,
        ray_address=flags.ray_address,
        dataset=_dataset(flags),
        sampling=_sampling(flags),
        scrape_interval=seconds("--scrape-interval", flags.scrape_interval) or 0.0,
        slice_duration=seconds("--slice-duration", flags.slice_duration) or 0.0,
    )
    opts.validate()
    return opts


def _dataset(flags: BenchFlags) -> DatasetSource | None:
    if flags.conversation not in ("single-turn", "multi-turn"):
        raise bad_flag("--conversation", f"{flags.conversation!r}: use single-turn or multi-turn")
    if flags.history not in ("recorded", "generated"):
        raise bad_flag("--history", f"{flags.history!r}: use recorded or generated")
    if flags.dataset is None:
        if (
            flags.dataset_format
            or flags.dataset_field
            or flags.min_input_len
            or flags.max_input_len
        ):
            raise bad_flag("--dataset", "the --dataset-*/--*-input-len flags need --dataset SRC")
        return None
    from servelab.bench.workloads.spec import DatasetSource

    try:
        return DatasetSource(
            dataset=flags.dataset,
            format=flags.dataset_format,
            field=flags.dataset_field,
            conversation=flags.conversation,
            history=flags.history,
            output_len=parse_output_len(flags.output_len),
            min_input_len=flags.min_input_len,
            max_input_len=flags.max_input_len,
        )
    except ValueError as e:  # pydantic's ValidationError is one
        raise fail(f"invalid dataset flags: {e}", "bench") from None


def _sampling(flags: BenchFlags) -> dict[str, object]:
    """``--extra-body`` with ``--temperature`` and ``--top-p`` over it."""
    temperature, top_p = flags.temperature, flags.top_p
    if temperature is not None and temperature < 0:
        raise bad_flag("--temperature", f"{temperature}: give a number >= 0")
    if top_p is not None and not 0 < top_p <= 1:
        raise bad_flag("--top-p", f"{top_p}: give a number in (0, 1]")
    sampling = parse_extra_body(flags.extra_body)
    if temperature is not None:
        sampling["temperature"] = temperature
    if top_p is not None:
        sampling["top_p"] = top_p
    return sampling
