"""Turn dataset conversations into the turns a plan sends: seeded order, vLLM's filters.

Conversations are visited in a seeded random order and tokenized only as far as the plan
needs them. Filters, counted by name: no user turn; a first prompt under 4 tokens or a
dataset output length under 4 (vLLM's ``is_valid_sequence``); ``--min-input-len`` /
``--max-input-len`` on the first prompt; a first turn whose prompt plus output exceeds the
context. A multi-turn session stops before the first turn whose history would not fit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servelab.bench.datasets import Conversation, Dataset

MIN_TOKENS = 4  # vLLM's min_len for a ShareGPT prompt and output
OUTPUT_LENS = ("dataset", "natural")


@dataclass(kw_only=True)
class Turn:
    """One request of a dataset session. ``reply`` is the recorded assistant reply that the
    next turn sends as history (None: the model's own reply is sent)."""

    prompt: str
    prompt_tokens: int
    max_tokens: int
    force: bool
    reply: str | None


@dataclass
class Selection:
    """What to take from a dataset, and how."""

    multi_turn: bool = False
    history: str = "recorded"  # or "generated"
    output_len: str | int = "dataset"  # "dataset", "natural" or a fixed N
    min_input_len: int | None = None
    max_input_len: int | None = None


def pairs(conv: Conversation) -> list[tuple[str, str | None]]:
    """(user text, recorded reply) per turn. System text goes in front of the first user
    text; consecutive user (or assistant) messages are joined; other roles are skipped."""
    system = [t for r, t in conv.messages if r == "system"]
    out: list[list[Any]] = []
    for role, text in conv.messages:
        if role == "user":
            if out and out[-1][1] is None:
                out[-1][0] += "\n" + text
            else:
                out.append([text, None])
        elif role == "assistant" and out:
            out[-1][1] = text if out[-1][1] is None else out[-1][1] + "\n" + text
    if out and system:
        out[0][0] = "\n".join(system) + "\n\n" + out[0][0]
    return [(u, a) for u, a in out]


@dataclass
class SessionSampler:
    """Sessions drawn from ``dataset`` in a seeded order; wraps around when all are used."""

    dataset: Dataset
    sel: Selection
    seed: int
    count: Callable[[str], int]  # tokens of a text as sent (chat template included)
    count_raw: Callable[[str], int]  # tokens of a text on its own
    max_model_len: int | None
    default_output: Callable[[], int] | None = None  # the class's output length, if any
    filtered: dict[str, int] = field(default_factory=dict)
    examined: int = 0
    kept: int = 0
    _order: list[int] = field(default_factory=list)
    _pos: int = 0
    _cache: dict[int, list[Turn] | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        self._order = rng.permutation(len(self.dataset.conversations)).tolist()

    def next(self) -> list[Turn]:
        for _ in range(len(self._order)):
            i = self._order[self._pos]
            self._pos = (self._pos + 1) % len(self._order)
            if i not in self._cache:
                self.examined += 1
                turns = self._turns(self.dataset.conversations[i])
                self._cache[i] = turns
                self.kept += turns is not None
            if self._cache[i] is not None:
                return self._cache[i]  # type: ignore[return-value]
        removed = ", ".join(f"{k}: {v}" for k, v in sorted(self.filtered.items()))
        raise ValueError(
            f"no usable record in {self.dataset.info.get('source')} after filtering "
            f"{self.examined} records ({removed})"
        )

    def _drop(self, why: str) -> None:
        self.filtered[why] = self.filtered.get(why, 0) + 1

    def _output(
        self, reply: str | None, conv: Conversation, first: bool
    ) -> tuple[int, bool] | None:
        out = self.sel.output_len
        if isinstance(out, int):
            return out, True
        if out == "natural":
            return -1, False  # sized to the context below
        if first and conv.output_len is not None:
            return conv.output_len, True
        if reply is not None:
            return self.count_raw(reply), True
        if self.default_output is not None:
            return self.default_output(), True
        return None

    def _turns(self, conv: Conversation) -> list[Turn] | None:
        ps = pairs(conv)
        if not ps:
            self._drop("no_user_turn")
            return None
        if not self.sel.multi_turn:
            ps = ps[:1]
        turns: list[Turn] = []
        history = 0
        for k, (user, reply) in enumerate(ps):
            n_in = self.count(user) if k == 0 else self.count_raw(user)
            out = self._output(reply, conv, k == 0)
            if k == 0:
                why = self._first_turn_filter(self.count_raw(user), n_in, out)
                if why is not None:
                    self._drop(why)
                    return None
            if out is None:
                break  # a later turn without a length to ask for ends the session
            n_out, force = out
            total = history + n_in
            if n_out < 0:  # natural: let the model stop, within the context
                n_out = max(1, (self.max_model_len or 4096) - total)
            if self.max_model_len is not None and total + n_out > self.max_model_len:
                if k == 0:
                    self._drop("over_context")
                    return None
                break
            keep = reply if self.sel.history == "recorded" else None
            turns.append(
                Turn(prompt=user, prompt_tokens=n_in, max_tokens=n_out, force=force, reply=keep)
            )
            history = total + (self.count_raw(keep) if keep is not None else n_out)
        return turns

    def _first_turn_filter(self, n_raw: int, n_in: int, out: tuple[int, bool] | None) -> str | None:
        """Why a first turn is dropped: vLLM's checks on the prompt's own tokens, the
        length flags on the prompt as sent (chat template included)."""
        if out is None:
            return "no_output_length"
        if n_raw < MIN_TOKENS:
            return "prompt_under_4_tokens"
        if self.sel.output_len == "dataset" and out[0] < MIN_TOKENS:
            return "output_under_4_tokens"
        if self.sel.min_input_len is not None and n_in < self.sel.min_input_len:
            return "min_input_len"
        if self.sel.max_input_len is not None and n_in > self.sel.max_input_len:
            return "max_input_len"
        return None

    def report(self) -> dict[str, Any]:
        """For the manifest: the dataset's pin, the selection, and what the filters did."""
        return {
            **self.dataset.info,
            "conversation": "multi-turn" if self.sel.multi_turn else "single-turn",
            "history": self.sel.history if self.sel.multi_turn else None,
            "output_len": self.sel.output_len,
            "min_input_len": self.sel.min_input_len,
            "max_input_len": self.sel.max_input_len,
            "seed": self.seed,
            "examined": self.examined,
            "kept": self.kept,
            "filtered": dict(self.filtered),
        }
