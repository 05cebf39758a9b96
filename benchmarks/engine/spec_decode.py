"""Does speculative decoding pay? Speculation on and off, side by side, through `servelab bench`.

One run starts a server per arm (``off``, ``--spec`` and, with ``--self-draft-layers``, a
self-draft arm), all alive together but loaded one at a time, and runs the same bench
workloads against each, arms interleaved within every cell so slow drift of a shared machine
hits all arms alike:

- ``copy-heavy`` (benchmarks/engine/workloads/copy_heavy.yaml): code files, continued through the
  completions endpoint at temperature 0; the continuation re-types much of the file.
- ``open-chat`` (benchmarks/engine/workloads/open_chat.yaml): questions on prose through the chat
  endpoint at the server's default temperature (1.0), where little can be predicted.

For each workload x concurrency (1 and 8) x arm: output tokens/s, TPOT and ITL (medians,
from the bench's metrics.json), and, from the server's vLLM counters, the acceptance rate
(accepted / proposed drafts) and mean accepted length (1 + accepted / proposals, vLLM's
definition). Ratios are against ``off`` in the same run. Before the load runs, a few
copy-heavy prompts are sent greedily to every arm and the texts compared: speculation must
not change greedy output.

The bench forces exact output lengths (``min_tokens`` + ``ignore_eos``), so a greedy small
model that runs past its natural end often loops; loops are easy to predict, which is why
open chat is sampled here. The temperature is not a bench option yet, so this script adds
it to the request body the bench sends (see ``_with_temperature``).

Figures are provisional whenever other work shares the machine: compare within one run.

Usage: python -m benchmarks.engine.spec_decode [--quick] [--model smollm2-135m] [--spec JSON]
       [--self-draft-layers 8] [--requests 8] [--out runs/spec_decode]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import re
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

import servelab.bench.run as bench_run
from servelab.bench.client.send import Target
from servelab.bench.run import BenchOptions, run_bench
from servelab.bench.servers.target import LaunchedServer
from servelab.bench.workloads.request_plan import LoadSpec, build_plan
from servelab.bench.workloads.spec import load_workload
from servelab.modelcore.tokenizer import Tokenizer

HERE = Path(__file__).parent
WORKLOADS = {
    # name: (spec file, endpoint, temperature; None = the server's default)
    "copy-heavy": (HERE / "workloads" / "copy_heavy.yaml", "completions", 0.0),
    "open-chat": (HERE / "workloads" / "open_chat.yaml", "chat", None),
}
DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 8}'
_COUNTER = re.compile(r"^(vllm:spec_decode_\w+?)_total\{([^}]*)\} (\S+)$", re.MULTILINE)


@dataclasses.dataclass
class Arm:
    name: str
    engine_args: str
    server: LaunchedServer | None = None


def spec_counters(url: str) -> dict[str, float]:
    """The server's vLLM spec_decode counters (per-position ones keyed ``name[pos]``)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for name, labels, value in _COUNTER.findall(text):
        pos = re.search(r'position="(\d+)"', labels)
        out[f"{name}[{pos.group(1)}]" if pos else name] = float(value)
    return out


def acceptance(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Acceptance rate and mean accepted length from two counter snapshots."""

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    drafts = delta("vllm:spec_decode_num_drafts")
    proposed = delta("vllm:spec_decode_num_draft_tokens")
    accepted = delta("vllm:spec_decode_num_accepted_tokens")
    return {
        "proposals": drafts,
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,
    }


@contextlib.contextmanager
def _with_temperature(temperature: float | None) -> Iterator[None]:
    """Make `servelab bench` send ``temperature`` in every request body (None: unchanged)."""
    if temperature is None:
        yield
        return

    def target(**kw: Any) -> Target:
        return Target(**kw, extra_body={"temperature": temperature})

    bench_run.Target = target
    try:
        yield
    finally:
        bench_run.Target = Target


def run_cell(
    arm: Arm, workload: str, concurrency: int, args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    """One bench run of ``workload`` at ``concurrency`` against ``arm``'s server."""
    spec_file, endpoint, temperature = WORKLOADS[workload]
    assert arm.server is not None
    url = arm.server.url
    before = spec_counters(url)
    run_dir = out / f"{workload}-c{concurrency}-{arm.name}"
    opts = BenchOptions(
        url=url,
        model=args.model,
        workload=str(spec_file),
        load=LoadSpec(
            concurrency=concurrency,
            requests=args.requests * max(1, concurrency // 2),
            length_scale=args.length_scale,
        ),
        endpoint=endpoint,
        out=run_dir,
        overwrite=True,
        quiet=True,
        seed=args.seed,
    )
    with _with_temperature(temperature):
        code = run_bench(opts, Console(quiet=True))
    metrics = json.loads((run_dir / "metrics.json").read_text())
    overall = metrics["overall"]
    lat = overall["latency"]
    return {
        "valid": code == 0,
        "output_tokens_per_s": overall["throughput"]["output_tokens_per_s"],
        "tpot_p50": lat["tpot"]["p50"],
        "itl_p50": lat["itl"]["p50"],
        "itl_p99": lat["itl"]["p99"],
        **acceptance(before, spec_counters(url)),
    }


def greedy_identity(arms: list[Arm], args: argparse.Namespace, tok: Tokenizer) -> dict[str, Any]:
    """Send a few copy-heavy prompts greedily to every arm; the texts must all agree."""
    spec_file, endpoint, _ = WORKLOADS["copy-heavy"]
    plan = build_plan(
        load_workload(str(spec_file)),
        LoadSpec(concurrency=1, requests=args.identity_prompts, length_scale=args.length_scale),
        args.seed,
        tokenizer=tok,
        endpoint=endpoint,
    )
    texts: dict[str, list[str]] = {}
    for arm in arms:
        assert arm.server is not None
        texts[arm.name] = []
        for req in plan:
            body = {
                "model": args.model,
                "prompt": req.prompt,
                "max_tokens": req.max_tokens,
                "temperature": 0,
            }
            r = httpx.post(f"{arm.server.url}/v1/completions", json=body, timeout=600)
            r.raise_for_status()
            texts[arm.name].append(r.json()["choices"][0]["text"])
    ref = texts[arms[0].name]
    return {arm.name: sum(a == b for a, b in zip(texts[arm.name], ref)) for arm in arms[1:]} | {
        "prompts": len(ref)
    }


def _fmt(v: float | None, scale: float = 1.0, unit: str = "", digits: int = 1) -> str:
    return "-" if v is None else f"{v * scale:,.{digits}f}{unit}"


def report(results: dict[str, dict[str, list[dict[str, Any]]]], arms: list[Arm]) -> list[str]:
    """One line per workload/concurrency/arm, with ratios to ``off`` (medians over repeats)."""

    def med(rows: list[dict[str, Any]], key: str) -> float | None:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    head = (
        f"{'cell':<18}{'arm':<12}{'out tok/s':>10}{'x off':>7}{'TPOT p50':>10}{'x off':>7}"
        f"{'ITL p50':>10}{'ITL p99':>10}{'accept':>8}{'acc len':>8}{'valid':>6}"
    )
    lines = [head]
    for cell, by_arm in results.items():
        base_tps = med(by_arm["off"], "output_tokens_per_s")
        base_tpot = med(by_arm["off"], "tpot_p50")
        for arm in arms:
            rows = by_arm[arm.name]
            tps, tpot = med(rows, "output_tokens_per_s"), med(rows, "tpot_p50")
            acc = med(rows, "acceptance_rate")
            lines.append(
                f"{cell:<18}{arm.name:<12}{_fmt(tps):>10}"
                f"{_fmt(tps / base_tps if tps and base_tps else None, 1, 'x', 2):>7}"
                f"{_fmt(tpot, 1e3, 'ms'):>10}"
                f"{_fmt(base_tpot / tpot if tpot and base_tpot else None, 1, 'x', 2):>7}"
                f"{_fmt(med(rows, 'itl_p50'), 1e3, 'ms'):>10}"
                f"{_fmt(med(rows, 'itl_p99'), 1e3, 'ms'):>10}"
                f"{_fmt(acc, 100, '%'):>8}{_fmt(med(rows, 'mean_accepted_length')):>8}"
                f"{'yes' if all(r['valid'] for r in rows) else 'NO':>6}"
            )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--spec", default=DEFAULT_SPEC, help="--speculative-config of the spec arm")
    ap.add_argument(
        "--self-draft-layers",
        type=int,
        default=None,
        help="also run a self-draft arm with this many target layers",
    )
    ap.add_argument("--requests", type=int, default=8, help="requests per cell (x c/2 at c>2)")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repeats of every cell")
    ap.add_argument("--length-scale", type=float, default=1.0)
    ap.add_argument("--identity-prompts", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/spec_decode"))
    ap.add_argument("--quick", action="store_true", help="a small size: checks the script runs")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.repeats, args.length_scale, args.identity_prompts = 2, 1, 0.25, 2
        args.concurrency = "1,2"
    k = json.loads(args.spec)["num_speculative_tokens"]
    arms = [
        Arm("off", ""),
        Arm(json.loads(args.spec)["method"], f"--speculative-config '{args.spec}'"),
    ]
    if args.self_draft_layers:
        sd = json.dumps(
            {
                "method": "self-draft",
                "num_speculative_tokens": min(k, 3),
                "num_layers": args.self_draft_layers,
            }
        )
        arms.append(Arm(f"self-draft{args.self_draft_layers}", f"--speculative-config '{sd}'"))
    args.out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_model(args.model)
    try:
        for arm in arms:
            arm.server = LaunchedServer(
                args.model, arm.engine_args, args.out / f"server-{arm.name}.log"
            )
        for arm in arms:
            asyncio.run(arm.server.wait_healthy())
        print(f"servers up: {', '.join(f'{a.name}={a.server.url}' for a in arms)}", flush=True)
        identity = greedy_identity(arms, args, tok)
        print(f"greedy identity (copy-heavy prompts equal to off): {identity}", flush=True)
        results: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for workload in WORKLOADS:
            for c in (int(x) for x in args.concurrency.split(",")):
                cell = results.setdefault(f"{workload} c={c}", {a.name: [] for a in arms})
                for rep in range(args.repeats):
                    order = arms if rep % 2 == 0 else arms[::-1]
                    for arm in order:
                        row = run_cell(arm, workload, c, args, args.out / f"rep{rep}")
                        cell[arm.name].append(row)
                        print(f"{workload} c={c} {arm.name} rep {rep}: {row}", flush=True)
    finally:
        for arm in arms:
            if arm.server is not None:
                arm.server.stop()
    lines = report(results, arms)
    print("\n".join(lines))
    (args.out / "summary.json").write_text(
        json.dumps({"identity": identity, "results": results, "table": lines}, indent=1)
    )
    return (
        0 if all(v == identity["prompts"] for k_, v in identity.items() if k_ != "prompts") else 1
    )


if __name__ == "__main__":
    sys.exit(main())
