"""export-hf round trips, and the real SmolLM2 against transformers on the exported directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_helpers import ROUND_TRIP_TEXTS
from typer.testing import CliRunner

from servelab.cli import app
from servelab.engine.batch_plan import BatchPlan, ScheduledSeq
from servelab.engine.sampling_params import SamplingParams
from servelab.model.llama import causal_batch
from servelab.model.loader import load_model
from servelab.model.torch_runner import TorchModelRunner
from servelab.modelcore.tokenizer import Tokenizer


def test_export_hf_cli_copies_an_hf_directory(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "exported"
    result = CliRunner().invoke(app, ["export-hf", "--model", str(tiny_llama_dir), str(out)])
    assert result.exit_code == 0, result.output
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file()
    again = CliRunner().invoke(app, ["export-hf", "--model", str(tiny_llama_dir), str(out)])
    assert again.exit_code == 2 and "not empty" in again.output
    a, b = load_model(str(tiny_llama_dir), "cpu"), load_model(str(out), "cpu")
    # The same weights: the same logits, bit for bit, at every position.
    batch = causal_batch([list(range(3, 40))])
    assert torch.equal(a.model(batch), b.model(batch))


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model exported from its GGUF into a fresh HF directory (once per session)."""
    out = tmp_path_factory.mktemp("smollm2_hf") / "model"
    result = CliRunner().invoke(app, ["export-hf", "--model", "smollm2-135m", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.slow
def test_exported_dir_is_a_standard_hf_model(smollm2_hf_dir: Path) -> None:
    cfg = json.loads((smollm2_hf_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"]) == (
        30,
        576,
        3,
    )
    assert cfg["tie_word_embeddings"] is True
    tok_cfg = json.loads((smollm2_hf_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]


@pytest.mark.slow
def test_gguf_tokenizer_equals_tokenizer_json_route(
    smollm2_path: Path, smollm2_hf_dir: Path
) -> None:
    from transformers import AutoTokenizer

    ours = Tokenizer.from_model(str(smollm2_path))
    via_json = Tokenizer.from_model(str(smollm2_hf_dir))
    hf = AutoTokenizer.from_pretrained(str(smollm2_hf_dir))
    for text in ROUND_TRIP_TEXTS:
        ids = ours.encode(text)
        assert ids == via_json.encode(text) == hf.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "Name a planet."}]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert via_json.eos_token_ids == ours.eos_token_ids == [2]


@pytest.mark.slow
def test_smollm2_greedy_tokens_match_transformers(smollm2_hf_dir: Path) -> None:
    """Our runner on the GGUF (via the weight cache) vs transformers on the exported dir."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(smollm2_hf_dir), dtype=torch.float32).eval()
    loaded = load_model("smollm2-135m", device="cpu")
    tok = loaded.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
        "The three primary colours are",
        "def fibonacci(n):",
    ]
    runner = TorchModelRunner(loaded, device="cpu", num_threads=1, seed=0)
    runner.allocate_kv(64, 16)
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    seqs = [tok.encode(p) for p in prompts]
    with torch.no_grad():
        expected = [
            ref.generate(
                torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None
            )[0, len(ids) :].tolist()
            for ids in seqs
        ]
    # All three prompts run together: one batched prefill, then batched decode steps.
    tables = [list(range(20 * i, 20 * i + 20)) for i in range(len(seqs))]
    ctx = [list(s) for s in seqs]
    done = [0] * len(seqs)
    outs: list[list[int]] = [[] for _ in seqs]
    for step in range(16):
        plan = BatchPlan(
            step,
            [
                ScheduledSeq(
                    str(i), ctx[i][done[i] :], done[i], tables[i], True, greedy, len(outs[i])
                )
                for i in range(len(seqs))
            ],
        )
        sampled = runner.execute(plan).sampled
        for i in range(len(seqs)):
            done[i] = len(ctx[i])
            outs[i] += sampled[str(i)]
            ctx[i] += sampled[str(i)]
    assert outs == expected
    assert "Paris" in tok.decode(outs[0])
