"""Test helpers: small real tokenizers built in memory from the benchmark corpus, and a
planned request to send by hand.

Used by the benchmark's tests and by anyone who needs a tokenizer without model files."""

from __future__ import annotations

from functools import cache

from servelab.bench.workloads.corpus import CODE, PROSE, QUESTIONS
from servelab.bench.workloads.request_plan import PlannedRequest
from servelab.vocab import RequestTags

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class HFTok:
    """The benchmark's tokenizer interface over a `tokenizers.Tokenizer`."""

    def __init__(self, tok, name: str) -> None:
        self._tok = tok
        self.name = name
        self.eos_token_ids = [0]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        from jinja2 import Template

        return Template(CHATML).render(
            messages=messages, add_generation_prompt=add_generation_prompt
        )


@cache
def tiny_tokenizer(byte_level: bool = True, vocab_size: int = 320) -> HFTok:
    """A small BPE trained on the benchmark corpus (many words take several tokens).

    ``byte_level=False`` trains one with no pre-tokenizer, whose merges cross spaces:
    the piece counts are then not additive and the prompt builder must correct itself.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if byte_level:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(list(PROSE) + list(CODE) + list(QUESTIONS), trainer=trainer)
    return HFTok(tok, f"tiny-bpe-{'bytelevel' if byte_level else 'nosplit'}-{vocab_size}")


def one_request(
    request_id: str,
    prompt: str,
    max_tokens: int,
    *,
    index: int = 0,
    prompt_tokens: int = 0,
    tags: RequestTags | None = None,
) -> PlannedRequest:
    """A request outside any plan, to hand to ``bench.client.send.send`` or a runner directly
    (``prompt_tokens`` 0: not known; the server's usage then gives the record's count)."""
    return PlannedRequest(
        request_id=request_id,
        index=index,
        tags=tags or RequestTags(),
        prompt=prompt,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
    )
