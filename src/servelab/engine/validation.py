"""What ``LLMEngine.add_request`` refuses, with ``ValueError``s that say how to fix it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from servelab.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from servelab.engine.detokenizer import TextTokenizer
    from servelab.engine.kv.kv_cache_plain import KVCache


def valid_prompt_ids(
    prompt: str | None,
    prompt_token_ids: list[int] | None,
    tokenizer: TextTokenizer | None,
    vocab_size: int | None,
) -> list[int]:
    """The prompt's token ids (``prompt_token_ids`` win over ``prompt``), a new list. Refused:
    no prompt, text without a tokenizer, an empty prompt, ids that are not ints in
    ``[0, vocab_size)`` (any int when the vocabulary size is unknown)."""
    if prompt_token_ids is None:
        if prompt is None:
            raise ValueError("give a prompt (text) or prompt_token_ids")
        if tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass prompt_token_ids instead")
        # Like vLLM's completions: the tokenizer adds BOS only if the model asks for it.
        prompt_token_ids = tokenizer.encode(prompt, add_special_tokens=True)
    ids = list(prompt_token_ids)
    if not ids:
        raise ValueError("the prompt is empty; give at least one token")
    limit = vocab_size
    # The usual prompt (plain ints in range) is checked by C loops; only a prompt that
    # fails that pays for the per-token search that names the bad ids. The sum of ints
    # is an int, and a float, numpy scalar, Decimal or Fraction among them makes it
    # another type (a string or None raises): one pass, a quarter of the cost of
    # collecting the element types.
    try:
        if type(sum(ids)) is int and min(ids) >= 0 and (not limit or max(ids) < limit):
            return ids
    except TypeError:
        pass
    bad = [t for t in ids if not isinstance(t, int) or t < 0 or (limit and t >= limit)]
    if bad:
        raise ValueError(
            f"prompt_token_ids contains invalid ids {bad[:5]}; ids must be integers in "
            f"[0, {limit if limit else 'vocab size'})"
        )
    return ids


def check_limits(
    num_prompt: int, sp: SamplingParams, max_model_len: int, kv: KVCache, has_tokenizer: bool
) -> None:
    """Refuse a request that could never run: prompt + ``max_tokens`` beyond the context
    (``max_model_len``) or the whole KV pool, or stop strings without a tokenizer."""
    limit = max_model_len
    if num_prompt >= limit:
        raise ValueError(
            f"the prompt has {num_prompt} tokens but the context is {limit} tokens "
            f"(max_model_len), leaving no room to generate; shorten the prompt to at most "
            f"{limit - 1} tokens"
        )
    if num_prompt + sp.max_tokens > limit:
        raise ValueError(
            f"prompt ({num_prompt} tokens) + max_tokens ({sp.max_tokens}) = "
            f"{num_prompt + sp.max_tokens} exceeds the context of {limit} tokens "
            f"(max_model_len); lower max_tokens to at most {limit - num_prompt} or shorten "
            "the prompt"
        )
    # The last sampled token never needs K/V, hence the - 1.
    blocks = kv.blocks_needed(num_prompt + sp.max_tokens - 1)
    if blocks > kv.num_blocks:
        raise ValueError(
            f"prompt ({num_prompt} tokens) + max_tokens ({sp.max_tokens}) needs {blocks} KV "
            f"blocks but the pool has {kv.num_blocks}; raise num_kv_blocks "
            "(or kv_cache_memory_gb), or lower max_tokens"
        )
    if sp.stop and not has_tokenizer:
        raise ValueError("stop strings need a tokenizer; use stop_token_ids instead")
