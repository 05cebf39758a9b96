"""llama.cpp's engine speed on a GGUF, in-process: what ``benchmarks.engine.engine_peers`` sets
beside servelab.

Runs in the llama-cpp-python venv that benchmarks/peers/install.sh builds, never in servelab's
(it imports only llama_cpp and the standard library), and prints one JSON object on stdout:

- ``prefill_<n>``: tokens/s for one sequence of n tokens decoded as one batch (llama.cpp's
  defaults split it into micro-batches of 512, as ``llama-server`` does);
- ``decode_<b>``: the median seconds of a step that adds one token to each of b sequences of
  ``--ctx`` tokens, logits at every row (what a serving engine samples from).

Token ids are random (no prefix reuse) and the KV cache is cleared between figures, so each
one starts cold as servelab's do. Threads: ``n_threads`` and ``n_threads_batch`` are both
``--threads``; the caller pins the process.

Usage: .venv-peers/llamacpp/bin/python benchmarks/peers/llamacpp_engine.py --model FILE.gguf
       [--threads 1] [--prefill 256,1024,2048] [--batches 1,8,32] [--ctx 256] [--steps 16]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import time

import llama_cpp as L


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


class Engine:
    def __init__(self, path: str, threads: int, n_ctx: int, n_seq: int, n_batch: int) -> None:
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_seq_max = n_ctx, n_batch, n_seq
        p.n_threads = p.n_threads_batch = threads
        p.kv_unified = True  # one pool for all sequences, as a serving engine's paged cache
        self.ctx = L.llama_init_from_model(self.model, p)
        if not self.ctx:
            raise SystemExit("llama.cpp could not create a context")
        self.batch = L.llama_batch_init(n_batch, 0, n_seq)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))

    def clear(self) -> None:
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> float:
        """One llama_decode of (token, position, sequence, wants logits) rows; its seconds."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = ctypes.c_int8(logits)
        b.n_tokens = len(rows)
        t0 = time.perf_counter()
        rc = L.llama_decode(self.ctx, b)
        L.llama_synchronize(self.ctx)
        if rc != 0:
            raise SystemExit(f"llama_decode returned {rc}")
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefill", type=_ints, default=[256, 1024, 2048])
    ap.add_argument("--batches", type=_ints, default=[1, 8, 32])
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    n_seq = max(a.batches)
    n_ctx = max(max(a.prefill), n_seq * (a.ctx + a.steps + 2)) + 16
    eng = Engine(a.model, a.threads, n_ctx, n_seq, max(2048, *a.prefill, n_seq))
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, eng.n_vocab) for _ in range(n)]

    out: dict[str, float] = {}
    for n in a.prefill:
        times = []
        for _ in range(a.repeat + 1):  # the first warms up
            eng.clear()
            times.append(eng.decode([(t, i, 0, i == n - 1) for i, t in enumerate(ids(n))]))
        out[f"prefill_{n}"] = n / min(times[1:])
    for b in a.batches:
        eng.clear()
        for s in range(b):
            eng.decode([(t, i, s, i == a.ctx - 1) for i, t in enumerate(ids(a.ctx))])
        steps = [
            eng.decode([(t, a.ctx + k, s, True) for s, t in enumerate(ids(b))])
            for k in range(a.steps + 1)
        ]
        out[f"decode_{b}"] = statistics.median(steps[1:])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
