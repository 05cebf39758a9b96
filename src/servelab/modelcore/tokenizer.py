"""The model's tokenizer and chat template. Imports no torch (the benchmark uses it).

Contract:
- ``Tokenizer.from_model(name_or_path)`` reads ``tokenizer.json`` (+ ``tokenizer_config.json``,
  ``generation_config.json``) of an HF directory, or rebuilds the same byte-level BPE
  tokenizer from a GGUF file's ``tokenizer.ggml.*`` metadata. A short name whose tokenizer
  ships inside servelab (``catalogue.SHIPPED_TOKENIZERS``: the default model's) loads the
  shipped files, so it needs neither the weights package nor a network.
- ``encode`` never adds BOS unless ``add_special_tokens=True``; special tokens written in
  the text (``<|im_start|>``) are recognised, so an encoded chat template is exact.
- ``apply_chat_template`` renders the model's own jinja template (HF's conventions:
  trim_blocks, lstrip_blocks, ``raise_exception``, ``bos_token``/``eos_token``).
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from servelab.modelcore.catalogue import SHIPPED_TOKENIZERS, is_gguf, resolve_model
from servelab.modelcore.gguf_meta import read_metadata

# llama.cpp's `tokenizer.ggml.pre` names -> the pre-tokenizer the original tokenizer.json
# used. The GPT-2 regex is ByteLevel's own; the others split with their regex first.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("gpt-2", "gpt2", "default"):
        return gpt2
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    regex = {"llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX}.get(pre)
    if regex is None:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported; use the model's HF directory "
            "(with tokenizer.json) instead, or export one with `servelab export-hf`"
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def from_gguf_metadata(meta: dict[str, Any]) -> tuple[HFTokenizer, dict[str, Any]]:
    """Build the byte-level BPE tokenizer from GGUF metadata; also return its config."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
            "use the model's HF directory with tokenizer.json instead"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type", [])
    tok.add_tokens(
        [
            AddedToken(tokens[i], special=(t == _CONTROL), normalized=False)
            for i, t in enumerate(types)
            if t in (_CONTROL, _USER_DEFINED)
        ]
    )
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos_id is not None
    byte_level = processors.ByteLevel(trim_offsets=False)
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.Sequence(
            [
                byte_level,
                processors.TemplateProcessing(
                    single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
                ),
            ]
        )
    else:
        tok.post_processor = byte_level
    eos_ids = [
        meta[k]
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        if meta.get(k) is not None
    ]
    config = {
        "bos_token": tokens[bos_id] if bos_id is not None else None,
        "eos_token": tokens[eos_ids[0]] if eos_ids else None,
        "chat_template": meta.get("tokenizer.chat_template"),
        "add_bos_token": add_bos,
        "eos_token_ids": sorted(set(eos_ids)),
    }
    return tok, config


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _from_hf_dir(path: Path) -> tuple[HFTokenizer, dict[str, Any]]:
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise ValueError(
            f"{path} has no tokenizer.json; servelab needs the fast-tokenizer file "
            "(save it with transformers' `tokenizer.save_pretrained`)"
        )
    tok = HFTokenizer.from_file(str(tok_file))
    tcfg = _read_json(path / "tokenizer_config.json")
    template = tcfg.get("chat_template")
    jinja_file = path / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    if isinstance(template, list):  # several named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    eos_ids: list[int] = []
    for cfg in (_read_json(path / "generation_config.json"), _read_json(path / "config.json")):
        value = cfg.get("eos_token_id")
        eos_ids += value if isinstance(value, list) else [value] if value is not None else []
    eos_token = _token_text(tcfg.get("eos_token"))
    eos_token_id = tok.token_to_id(eos_token) if eos_token is not None else None
    if eos_token_id is not None:
        eos_ids.append(eos_token_id)
    config = {
        "bos_token": _token_text(tcfg.get("bos_token")),
        "eos_token": eos_token,
        "chat_template": template,
        "add_bos_token": bool(tcfg.get("add_bos_token", False)),
        "eos_token_ids": sorted(set(eos_ids)),
    }
    return tok, config


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template."""

    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any], name: str) -> None:
        self._tok = tokenizer
        self._config = config
        self.name = name
        self.eos_token_ids: list[int] = list(config.get("eos_token_ids", []))
        self.bos_token: str | None = config.get("bos_token")
        self.eos_token: str | None = config.get("eos_token")
        self.chat_template: str | None = config.get("chat_template")

    @classmethod
    def from_model(cls, name_or_path: str) -> Tokenizer:
        """The tokenizer of a short model name, a ``.gguf`` file or an HF directory."""
        shipped = SHIPPED_TOKENIZERS.get(name_or_path.strip().lower())
        if shipped is not None:
            tok, config = _from_hf_dir(shipped)
            return cls(tok, config, name=name_or_path)
        path = resolve_model(name_or_path)
        if is_gguf(path):
            tok, config = from_gguf_metadata(read_metadata(path))
        else:
            tok, config = _from_hf_dir(path)
        return cls(tok, config, name=name_or_path)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> HFTokenizer:
        """The underlying `tokenizers` object (to save as tokenizer.json)."""
        return self._tok

    @property
    def add_bos_token(self) -> bool:
        return bool(self._config.get("add_bos_token", False))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        encodings = self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @cached_property
    def _template(self) -> Any:
        if not self.chat_template:
            raise ValueError(
                f"model {self.name!r} has no chat template; send plain completions "
                "(/v1/completions) instead of chat messages"
            )
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` (``{"role", "content"}`` dicts) with the model's template."""
        if not messages:
            raise ValueError("messages must not be empty")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
