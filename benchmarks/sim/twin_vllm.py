"""A twin of live vLLM (CPU build): calibrate on one run, predict held-out runs, run them for real.

    python -m benchmarks.sim.twin_vllm [--out runs/twin-vllm] [--cases smoke|all|NAME,...]
        [--vllm-python .venv-peers/vllm/bin/python] [--weights DIR] [--seeds 8]

1. vLLM serves SmolLM2-135M (weights from ``servelab export-hf``) on CPU 1, launched from a
   command template (``bench.servers.template``: its own process group, its log, the command in the
   manifest), one server per set of flags, relaunched between flag sets, its prefix cache
   emptied before every measured run (the runs share sessions; the twin starts cold); the
   client runs on CPU 0 (``taskset``).
2. ``servelab bench`` runs the training case; ``servelab calibrate`` fits the twin to it
   (steps inferred from the client's chunk arrivals, vLLM's settings from its ``/metrics``
   and ``/v1/models``, the stated flags and vLLM's CPU defaults).
3. For each held-out case -- another workload shape, rate or concurrency, or other vLLM
   flags (chunked prefill off, another chunk budget, prefix caching off) -- the twin
   predicts it and vLLM runs it (``benchmarks.sim.twin_check``: the comparison, its table
   and ``results.json``).

``--reuse`` calibrates and predicts again on the real runs already in ``--out`` (seconds):
for working on the twin against fixed runs. ``--cases smoke`` is the training case and one
held-out case (about 5 minutes on a quiet
machine); ``all`` every case below. The figures are this machine's: a 2-core host shared
with other work drifts by 10-20% over minutes.
"""

from __future__ import annotations

import argparse
import urllib.request
from pathlib import Path

from benchmarks.common import ROOT
from benchmarks.sim.twin_check import (
    SERVELAB,
    Case,
    Peer,
    add_check_arguments,
    bench,
    check,
    run,
    training,
)

VLLM_PYTHON = str(ROOT / ".venv-peers" / "vllm" / "bin" / "python")  # install.sh's default
SERVED = "smollm2-135m"
# VLLM_SERVER_DEV_MODE=1 opens POST /reset_prefix_cache: every measured run starts from a cold
# prefix cache, as its prediction does (the cases share a server and their prompts).
TEMPLATE = (
    "env -u PYTHONPATH OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_SERVER_DEV_MODE=1 "
    "taskset -c {cpu} {python} "
    "-m vllm.entrypoints.openai.api_server --model {{model}} --served-model-name {served} "
    "--host {{host}} --port {{port}} --enable-per-request-metrics --enforce-eager {{flags}}"
)

TRAIN = Case("train chat c4", "chat", "--concurrency 4 --requests 16", train=True)
HELD_OUT = (
    Case("rag c4", "rag", "--concurrency 4 --requests 12"),
    Case("chat rate 1.2/s", "chat", "--rate 1.2 --requests 16"),
    Case("chat c8", "chat", "--concurrency 8 --requests 24"),
    Case("chat c4 budget 128", "chat", "--concurrency 4 --requests 16",
         "--max-num-batched-tokens 128"),
    Case("rag c4 no chunking", "rag", "--concurrency 4 --requests 12",
         "--no-enable-chunked-prefill"),
    Case("chat c4 no prefix cache", "chat", "--concurrency 4 --requests 16",
         "--no-enable-prefix-caching"),
)  # fmt: skip
SMOKE = ("chat c4 budget 128",)


def reset_prefix_cache(url: str) -> None:
    """Empty the server's prefix cache (vLLM's dev-mode endpoint); raises when it cannot."""
    req = urllib.request.Request(f"{url}/reset_prefix_cache", method="POST", data=b"")
    with urllib.request.urlopen(req, timeout=30) as resp:
        if resp.status != 200:
            raise RuntimeError(f"POST {url}/reset_prefix_cache answered {resp.status}")


def vllm_peer(python: str, weights: Path) -> Peer:
    def warm_up(url: str, case: Case, run_dir: Path, logs: Path) -> float:
        # A fresh vLLM's first batches are several times slower: not the server predicted.
        warm = Case("warm-up", "chat", "--concurrency 4 --requests 4", case.flags)
        return bench(peer, warm, url, run_dir, logs)

    peer = Peer(
        name="vllm",
        template=TEMPLATE.format(cpu=1, python=python, served=SERVED),
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
    ap.add_argument("--cases", default="smoke", help="smoke, all, or held-out case names")
    ap.add_argument("--vllm-python", default=VLLM_PYTHON)
    ap.add_argument("--weights", default=None, help="HF weights dir (default: exported)")
    add_check_arguments(ap, health_timeout=900.0)
    args = ap.parse_args()
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    weights = Path(args.weights) if args.weights else out / "weights"
    if not (weights / "config.json").exists():
        timings["export_s"] = run(
            [*SERVELAB, "export-hf", "--model", SERVED, str(weights)], out / "logs" / "export.log"
        )
    wanted = {
        "smoke": SMOKE,
        "all": tuple(c.name for c in HELD_OUT),
    }.get(args.cases, tuple(args.cases.split(",")))
    held = [c for c in HELD_OUT if c.name in wanted]
    train = training(TRAIN, args.train_runs)
    peer = vllm_peer(args.vllm_python, weights)
    check(peer, train, held, out, args.seeds, args.tolerance, args.health_timeout, args.reuse,
          timings)  # fmt: skip


if __name__ == "__main__":
    main()
