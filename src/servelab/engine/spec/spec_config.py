"""The speculative-decoding configuration: vLLM's ``--speculative-config`` JSON, validated.

Pure Python (the CLI validates flags before any model is loaded). Contract:
``SpeculativeConfig.from_dict(d)`` / ``parse_speculative_config(text)`` return a frozen
config or raise ``ValueError`` naming the field and saying what works. ``to_dict()`` gives
back the JSON form, which is what ``EngineConfig.speculative_config`` carries (it must
survive ``dataclasses.asdict`` and the JSON hop to the engine-core process).

Methods:
- ``ngram``: prompt lookup; ``prompt_lookup_min``..``prompt_lookup_max`` tokens of suffix.
- ``draft``: a smaller model with the target's tokenizer (``model``: a name or path).
- ``self-draft``: the target's first ``num_layers`` layers plus its head, sharing weights.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

METHODS = ("ngram", "draft", "self-draft")
MAX_SPECULATIVE_TOKENS = 16  # beyond this a verification step costs more than it can win
_DEFAULT_LOOKUP_MIN = 2
_DEFAULT_LOOKUP_MAX = 4
_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4}'
# Which optional fields belong to which method; any other key is an error.
_METHOD_FIELDS = {
    "ngram": {"prompt_lookup_min", "prompt_lookup_max"},
    "draft": {"model"},
    "self-draft": {"num_layers"},
}
_COMMON_FIELDS = {"method", "num_speculative_tokens", "adaptive"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to propose draft tokens. ``adaptive`` backs off per request when drafts keep
    failing (see ``servelab.engine.spec.policy``)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    num_layers: int | None = None
    adaptive: bool = True

    @classmethod
    def from_dict(cls, d: Any) -> SpeculativeConfig:
        """Validate a dict such as ``{"method": "ngram", "num_speculative_tokens": 4}``."""
        if not isinstance(d, dict):  # user input: callers report ValueErrors
            raise ValueError(  # noqa: TRY004
                f"the speculative config must be a JSON object such as {_EXAMPLE}"
            )
        method = d.get("method")
        if method not in METHODS:
            raise ValueError(
                f"speculative config: method {method!r} is not known; use one of "
                f"{', '.join(METHODS)} (e.g. {_EXAMPLE})"
            )
        allowed = _COMMON_FIELDS | _METHOD_FIELDS[method]
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise ValueError(
                f"speculative config: method {method!r} takes no {', '.join(unknown)}; its "
                f"fields are {', '.join(sorted(allowed))}"
            )
        k = _positive_int(d, "num_speculative_tokens", required=True)
        if k > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative config: num_speculative_tokens must be at most "
                f"{MAX_SPECULATIVE_TOKENS}, got {k}"
            )
        adaptive = d.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(  # noqa: TRY004
                f"speculative config: adaptive must be true or false, got {adaptive!r}"
            )
        fields: dict[str, Any] = {}
        if method == "ngram":
            lo = _positive_int(d, "prompt_lookup_min")
            hi = _positive_int(d, "prompt_lookup_max")
            hi = hi if hi is not None else max(_DEFAULT_LOOKUP_MAX, lo or 0)
            lo = lo if lo is not None else min(_DEFAULT_LOOKUP_MIN, hi)
            if lo > hi:
                raise ValueError(
                    f"speculative config: prompt_lookup_min ({lo}) must not exceed "
                    f"prompt_lookup_max ({hi})"
                )
            fields = {"prompt_lookup_min": lo, "prompt_lookup_max": hi}
        elif method == "draft":
            model = d.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError(
                    'speculative config: method "draft" needs "model": a model name, HF '
                    "directory or .gguf file that shares the target's tokenizer"
                )
            fields = {"model": model}
        else:
            fields = {"num_layers": _positive_int(d, "num_layers", required=True)}
        return cls(method=method, num_speculative_tokens=k, adaptive=adaptive, **fields)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (only the fields that apply to the method)."""
        keep = _COMMON_FIELDS | _METHOD_FIELDS[self.method]
        return {k: v for k, v in asdict(self).items() if k in keep}


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """Parse the ``--speculative-config`` JSON text (see ``SpeculativeConfig.from_dict``)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"--speculative-config is not valid JSON ({e.msg} at character {e.pos}); "
            f"write e.g. '{_EXAMPLE}'"
        ) from None
    return SpeculativeConfig.from_dict(data)


def _positive_int(d: dict[str, Any], key: str, required: bool = False) -> Any:
    v = d.get(key)
    if v is None:
        if required:
            raise ValueError(f"speculative config: {key} is required (a positive integer)")
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"speculative config: {key} must be a positive integer, got {v!r}")
    return v
