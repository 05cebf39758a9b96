"""Per-request figures that other servers put in their responses, in servelab's vocabulary.

Read by capability, not by product name: whichever of these objects a response carries
is read, and a server that sends none is handled on client times alone. The field names
were checked against each server's source (versions in docs/metrics.md).

- vLLM (``--enable-per-request-metrics``): ``metrics`` in the final usage chunk of a
  stream and in a whole response: ``queue_time_ms`` (queued -> scheduled),
  ``time_to_first_token_ms`` (scheduled -> first token), ``generation_time_ms``,
  ``mean_itl_ms``, ``tokens_per_second``.
- llama.cpp server: ``timings`` in the last chunk of a stream and in a whole response:
  ``prompt_ms`` and ``prompt_n`` (the prompt tokens it computed), ``cache_n`` (prompt
  tokens reused from the slot's cache), ``predicted_ms``.
- SGLang: ``meta_info``, at the top of its native ``/generate`` answer and on each choice
  of a whole ``/v1/chat/completions`` response whose request asked for it
  (``return_meta_info: true``; SGLang refuses that on a stream): ``cached_tokens``,
  ``e2e_latency`` (seconds), and with ``--enable-metrics`` ``queue_time`` (seconds) and
  the timestamps ``forward_entry_time`` and ``prefill_finished_time``, whose difference
  is the prefill (first scheduled -> prefill done).

The result is stored as the record's ``server_timeline``, with the keys of
``RequestTimeline.summary()`` (``queue_time``, ``prefill_time``, ``decode_time`` in
seconds, ``cached_prompt_tokens``) and ``reported_by`` naming the object it came from.
docs/metrics.md maps every field.
"""

from __future__ import annotations

import math
from typing import Any

VLLM, LLAMACPP, SGLANG = "vllm metrics", "llama.cpp timings", "sglang meta_info"

# (source object, its field, our key, scale to seconds or 1 for counts)
_FIELDS: dict[str, tuple[tuple[str, str, float], ...]] = {
    "metrics": (
        ("queue_time_ms", "queue_time", 1e-3),
        ("time_to_first_token_ms", "prefill_time", 1e-3),
        ("generation_time_ms", "decode_time", 1e-3),
        ("mean_itl_ms", "mean_itl", 1e-3),
        ("tokens_per_second", "tokens_per_second", 1.0),
    ),
    "timings": (
        ("prompt_ms", "prefill_time", 1e-3),
        ("predicted_ms", "decode_time", 1e-3),
        ("prompt_n", "prompt_tokens_computed", 1.0),
        ("cache_n", "cached_prompt_tokens", 1.0),
    ),
    "meta_info": (
        ("queue_time", "queue_time", 1.0),
        ("cached_tokens", "cached_prompt_tokens", 1.0),
        ("e2e_latency", "e2e_time", 1.0),
    ),
}
# (source object, start timestamp, end timestamp, our key): a duration as two wall-clock
# stamps of the server's.
_SPANS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "meta_info": (("forward_entry_time", "prefill_finished_time", "prefill_time"),),
}
_REPORTED_BY = {"metrics": VLLM, "timings": LLAMACPP, "meta_info": SGLANG}
_COUNTS = {"prompt_tokens_computed", "cached_prompt_tokens"}


class MalformedFigures(ValueError):
    """A per-request figures object that is present but cannot be read."""


def _number(kind: str, obj: dict[str, Any], src: str) -> float | None:
    v = obj.get(src)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise MalformedFigures(f"{kind}.{src} = {v!r} is not a non-negative number")
    return v


def read_figures(kind: str, obj: Any) -> dict[str, Any] | None:
    """``obj`` (the response's ``metrics``/``timings``/``meta_info``) in our vocabulary.

    None when it holds none of the fields we read; ``MalformedFigures`` when a field we
    read is not a finite, non-negative number, or a span ends before it starts.
    """
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise MalformedFigures(f"{kind} is a {type(obj).__name__}, not an object")
    out: dict[str, Any] = {}
    for src, key, scale in _FIELDS[kind]:
        v = _number(kind, obj, src)
        if v is not None:
            out[key] = int(v) if key in _COUNTS else float(v) * scale
    for start, end, key in _SPANS.get(kind, ()):
        a, b = _number(kind, obj, start), _number(kind, obj, end)
        if a is not None and b is not None:
            if b < a:
                raise MalformedFigures(f"{kind}.{end} = {b!r} is before {kind}.{start} = {a!r}")
            out[key] = float(b - a)
    if not out:
        return None
    out["reported_by"] = _REPORTED_BY[kind]
    return out


def figures_from(objects: dict[str, Any]) -> dict[str, Any] | None:
    """The first readable figures among a response's candidate objects (by field name):
    its top-level ``metrics``/``timings``/``meta_info``, or the first choice's
    ``meta_info`` (where SGLang's chat completions put it)."""
    for kind in _FIELDS:
        obj = objects.get(kind)
        if obj is None and kind == "meta_info":
            obj = _first_choice(objects).get("meta_info")
        got = read_figures(kind, obj)
        if got is not None:
            return got
    return None


def _first_choice(objects: dict[str, Any]) -> dict[str, Any]:
    choices = objects.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    return first if isinstance(first, dict) else {}


def ignored(reason: str) -> dict[str, Any]:
    """What a record keeps of figures it could not read: the reason, and nothing to use."""
    return {"reported_by": "ignored", "ignored": reason}
