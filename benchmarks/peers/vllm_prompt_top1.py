"""Teacher-forced top-1 next tokens from vLLM's own engine, run inside vLLM's venv.

Reads a JSON list of token-id windows on stdin; for each window asks vLLM for one prompt
logprob per position (``prompt_logprobs=1``: the actual token and the most likely one) and
writes, as JSON to OUT (vLLM prints its own progress on stdout), ``{"top1": [...], "nll": x}``: the rank-1 token id predicted
at every position after the first, and the summed negative log-likelihood of the actual
tokens there.
It imports only the standard library and vllm, so it runs in a peer's venv without
servelab's sources.

Usage: python vllm_prompt_top1.py MODEL_DIR DTYPE OUT < windows.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir, dtype, out_path = sys.argv[1:4]
    windows: list[list[int]] = json.load(sys.stdin)
    llm = LLM(model=model_dir, dtype=dtype, enforce_eager=True, max_model_len=2048, seed=0)
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], sp)
    top1: list[int] = []
    nll = 0.0
    for w, out in zip(windows, outs):
        # position 0 has no logprobs; position i holds the distribution that predicted token i
        for tok, lp in zip(w[1:], out.prompt_logprobs[1:]):
            top1.append(next(t for t, v in lp.items() if v.rank == 1))
            nll -= lp[tok].logprob
    Path(out_path).write_text(json.dumps({"top1": top1, "nll": nll}))


if __name__ == "__main__":
    main()
