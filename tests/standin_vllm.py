"""A stand-in for `vllm serve` in tests: the bench's test server with planted engine steps,
configured by vLLM's own scheduler flags, so a launch template can relaunch it with a
candidate's flags (``--max-num-batched-tokens``, ``--[no-]enable-chunked-prefill``,
``--max-num-seqs``). It caches no prefix, so runs of it state ``--no-enable-prefix-caching``.

    python tests/standin_vllm.py --host H --port P [--step-base S] [vLLM flags]
"""

from __future__ import annotations

import argparse
import json
import sys

from servelab.testing import testserver

# The planted step cost (bench.teststeps.StepPlan): a step, a decode, a prefill token.
STEPS = {"base": 0.01, "per_decode": 0.002, "per_prefill_token": 0.0001}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    args, _ = ap.parse_known_args(argv)
    plan = {
        **STEPS,
        "budget": args.max_num_batched_tokens if args.enable_chunked_prefill else 0,
        "max_seqs": args.max_num_seqs,
    }
    schedule = {"steps": plan, "report": "none", "metrics": "missing"}
    testserver.main(
        ["--host", args.host, "--port", str(args.port), "--schedule", json.dumps(schedule)]
    )


if __name__ == "__main__":
    main(sys.argv[1:])
