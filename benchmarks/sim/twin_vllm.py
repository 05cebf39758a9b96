"""A twin of live vLLM (CPU build) against the held-out protocol: train, predict, run for real.

    python -m benchmarks.sim.twin_vllm [--out runs/twin-vllm] [--cases all|smoke|NAME,...]
        [--vllm-python .venv-peers/vllm/bin/python] [--weights DIR] [--seeds 8]
        [--train-plan]

1. vLLM serves SmolLM2-135M (weights from ``servelab export-hf``) on CPU 1, launched from a
   command template (``bench.servers.template``: its own process group, its log, the command in the
   manifest), a fresh server for every measured run, warmed up and its prefix cache emptied
   before it (the twin starts cold); the client runs on CPU 0 (``taskset``).
2. ``servelab bench`` runs the training case (chat at concurrency 4, seed 1) on two
   launches; ``servelab calibrate`` fits the twin to both (steps inferred from the client's
   chunk arrivals, vLLM's settings from its ``/metrics`` and ``/v1/models``, the stated flags
   and vLLM's CPU defaults). ``--train-plan``: ``servelab calibrate --plan`` on a launch of
   its own instead.
3. Each held-out case (``HELD_OUT``: its own seed, its own server) is predicted by the twin
   and run for real; ``benchmarks.sim.twin_check`` scores them (MAPE per figure, the naive
   baseline, the change error, the intervals' coverage) and writes ``results.json``.

Expected time on a quiet 2-core machine: 11 launches of 35-40 s with a 5-6 s warm-up each
(about 8 minutes), 11 bench runs of 10-60 s (about 5 minutes), 10 predictions of a few
seconds: about 15-20 minutes; ``--train-plan`` adds a launch and the ladder (3-5 minutes);
a busy host stretches it to 30-40. ``--reuse`` calibrates and predicts again on the real
runs already in ``--out`` (a minute). ``--cases smoke`` is one held-out case (about 4
minutes; not the protocol).
"""

from __future__ import annotations

import argparse
import urllib.request
from pathlib import Path

from benchmarks.common import ROOT
from benchmarks.sim.twin_check import (
    SERVELAB,
    SERVER_CPU,
    Case,
    Peer,
    add_check_arguments,
    bench,
    check,
    run,
    select,
    training,
)

VLLM_PYTHON = str(ROOT / ".venv-peers" / "vllm" / "bin" / "python")  # install.sh's default
SERVED = "smollm2-135m"
# VLLM_SERVER_DEV_MODE=1 opens POST /reset_prefix_cache: every measured run starts from a cold
# prefix cache, as its prediction does (the warm-up sends chat sessions of its own).
TEMPLATE = (
    "env -u PYTHONPATH OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_SERVER_DEV_MODE=1 "
    "taskset -c {cpu} {python} "
    "-m vllm.entrypoints.openai.api_server --model {{model}} --served-model-name {served} "
    "--host {{host}} --port {{port}} --enable-per-request-metrics --enforce-eager {{flags}}"
)

TRAIN = Case("train chat c4", "chat", "--concurrency 4 --requests 16", train=True, seed=1)
# The held-out set, committed before any of it was measured (docs/design/twin.md, "The
# held-out protocol"): new shapes (rag, codegen, agent, bursty gamma arrivals), new loads
# (concurrency 8, Poisson 1.2/s), new flags (a 128-token budget, chunking off, prefix
# caching off); seeds 101-109, none used in training.
HELD_OUT = (
    Case("rag c4", "rag", "--concurrency 4 --requests 12", seed=101),
    Case("codegen c4", "codegen", "--concurrency 4 --requests 12", seed=102),
    Case("agent c4", "agent", "--concurrency 4 --requests 8", seed=103),
    Case("chat bursty 1.2/s", "chat",
         "--rate 1.2 --arrival gamma --burstiness 0.25 --requests 16", seed=104),
    Case("chat rate 1.2/s", "chat", "--rate 1.2 --requests 16", seed=105),
    Case("chat c8", "chat", "--concurrency 8 --requests 24", seed=106),
    Case("chat c4 budget 128", "chat", "--concurrency 4 --requests 16",
         "--max-num-batched-tokens 128", seed=107),
    Case("rag c4 no chunking", "rag", "--concurrency 4 --requests 12",
         "--no-enable-chunked-prefill", seed=108),
    Case("chat c4 no prefix cache", "chat", "--concurrency 4 --requests 16",
         "--no-enable-prefix-caching", seed=109),
)  # fmt: skip
SMOKE = ("chat c4 budget 128",)


def reset_prefix_cache(url: str) -> None:
    """Empty the server's prefix cache (vLLM's dev-mode endpoint); raises when it cannot."""
    req = urllib.request.Request(f"{url}/reset_prefix_cache", method="POST", data=b"")
    with urllib.request.urlopen(req, timeout=30) as resp:
        if resp.status != 200:
            raise RuntimeError(f"POST {url}/reset_prefix_cache answered {resp.status}")


def exported_weights(weights: Path, log: Path, timings: dict[str, float]) -> Path:
    """``weights``, written there first by ``servelab export-hf`` where it holds no model
    (the time it took in ``timings["export_s"]``)."""
    if not (weights / "config.json").exists():
        timings["export_s"] = run([*SERVELAB, "export-hf", "--model", SERVED, str(weights)], log)
    return weights


def vllm_peer(python: str, weights: Path) -> Peer:
    def warm_up(url: str, case: Case, run_dir: Path, logs: Path) -> float:
        # A fresh vLLM's first batches are several times slower: not the server predicted.
        warm = Case("warm-up", "chat", "--concurrency 4 --requests 4", case.flags)
        return bench(peer, warm, url, run_dir, logs)

    peer = Peer(
        name="vllm",
        template=TEMPLATE.format(cpu=SERVER_CPU, python=python, served=SERVED),
        stated=f"vllm serve {weights}",
        model=str(weights),
        tokenizer=str(weights),
        reset=reset_prefix_cache,
        warm_up=warm_up,
    )
    return peer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/twin-vllm")
    ap.add_argument("--cases", default="all", help="all, smoke, or held-out case names")
    ap.add_argument("--vllm-python", default=VLLM_PYTHON)
    ap.add_argument("--weights", default=None, help="HF weights dir (default: exported)")
    add_check_arguments(ap, health_timeout=900.0)
    args = ap.parse_args()
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    weights = exported_weights(
        Path(args.weights) if args.weights else out / "weights",
        out / "logs" / "export.log",
        timings,
    )
    held = select(HELD_OUT, args.cases, {"smoke": SMOKE}, args.held_seeds)
    train = training(TRAIN, args.train_runs)
    peer = vllm_peer(args.vllm_python, weights)
    check(peer, train, held, out, args.seeds, args.health_timeout, args.reuse, timings,
          args.train_plan, args.train_plan_and_runs)  # fmt: skip


if __name__ == "__main__":
    main()
