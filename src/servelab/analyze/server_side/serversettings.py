"""Another server's scheduler settings, in servelab's engine-config names, and where each came from.

A run against vLLM, SGLang or llama.cpp has no resolved engine config in its manifest. What
the diagnosis and the simulator's twin need -- is prefill chunked, at what token budget, how
many sequences per step, is the prefix cache on -- is read, in this order (the first source
that states a setting wins):

1. what the server reports about itself: ``/v1/models`` (``max_model_len``) and the labels of
   its ``/metrics`` info gauges (vLLM's ``vllm:cache_config_info``: ``block_size``,
   ``enable_prefix_caching``, ``num_gpu_blocks``);
2. the command it was launched with, where servelab launched it from a template
   (``server.command`` in the manifest);
3. the command or flags the user stated (``servelab bench --server-config``, recorded as
   ``server.stated_command``; or given to the command that reads the run);
4. the engine's published defaults (``DEFAULTS``: only its switches; the budget and sequence
   cap depend on the hardware or are left to the simulator's twin, and stay unknown here
   unless stated, so a recommendation words them as a rule rather than a guess).

``FLAGS`` is the one table of each engine's spelling of each setting: it parses launch
commands (2, 3) and renders a candidate setting as that server's flags (``render_flags``),
for a launch template's ``{flags}``. Only the settings a launch template can change are in it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

from servelab.rundir import Run

VLLM, SGLANG, LLAMACPP, SERVELAB, OTHER = "vllm", "sglang", "llamacpp", "servelab", "other"

# How a server says who it is, as the client sees it: the ``owned_by`` every model in its
# ``/v1/models`` carries, and the start of ``reported_by`` for the per-request figures its
# responses carried (bench/client/serverfigures.py). Checked against each server's source; the
# versions are in docs/design/analyze.md.
RECOGNISED = {
    VLLM: ("vllm", "vllm"),
    SGLANG: ("sglang", "sglang"),
    LLAMACPP: ("llamacpp", "llama.cpp"),
}

# A launch command names its server by one of these words (the program, or the module run
# with ``python -m``).
_PROGRAMS = {
    VLLM: ("vllm", "vllm.entrypoints.openai.api_server"),
    SGLANG: ("sglang.launch_server", "sglang"),
    LLAMACPP: ("llama-server", "llama.cpp"),
}


@dataclass(frozen=True)
class ServerFlag:
    """One setting as one server's command line takes it.

    ``kind``: ``value`` (``--flag N``), ``bool`` (``--flag`` / ``--no-flag``, vLLM's style),
    ``off`` (the flag's presence sets the setting False), or ``value_or_off`` (``--flag N``,
    where ``off_value`` turns the setting named by ``switch`` off instead)."""

    key: str
    flags: tuple[str, ...]
    kind: str = "value"
    switch: str | None = None
    off_value: int | None = None


FLAGS: dict[str, tuple[ServerFlag, ...]] = {
    # vllm/engine/arg_utils.py EngineArgs.add_cli_args
    VLLM: (
        ServerFlag("max_num_batched_tokens", ("--max-num-batched-tokens",)),
        ServerFlag("max_num_seqs", ("--max-num-seqs",)),
        ServerFlag("enable_chunked_prefill", ("--enable-chunked-prefill",), "bool"),
        ServerFlag("enable_prefix_caching", ("--enable-prefix-caching",), "bool"),
        ServerFlag("block_size", ("--block-size",)),
        ServerFlag("max_model_len", ("--max-model-len",)),
        ServerFlag("num_kv_blocks", ("--num-gpu-blocks-override",)),
    ),
    # python/sglang/srt/server_args.py ServerArgs.add_cli_args; a chunk size of -1 turns
    # chunking off
    SGLANG: (
        ServerFlag(
            "max_num_batched_tokens",
            ("--chunked-prefill-size",),
            "value_or_off",
            "enable_chunked_prefill",
            -1,
        ),
        ServerFlag("max_num_seqs", ("--max-running-requests",)),
        ServerFlag("enable_prefix_caching", ("--disable-radix-cache",), "off"),
        ServerFlag("block_size", ("--page-size",)),
        ServerFlag("max_model_len", ("--context-length",)),
    ),
    # llama.cpp common/arg.cpp: a prompt is always cut into --batch-size pieces (no switch)
    LLAMACPP: (
        ServerFlag("max_num_batched_tokens", ("--batch-size", "-b")),
        ServerFlag("max_num_seqs", ("--parallel", "-np")),
        ServerFlag("kv_tokens", ("--ctx-size", "-c")),
        ServerFlag("enable_prefix_caching", ("--cache-prompt",), "bool"),
    ),
}

# Settings each engine starts with whatever the hardware, with where that is written.
DEFAULTS: dict[str, tuple[dict[str, Any], str]] = {
    VLLM: (
        {"enable_chunked_prefill": True, "enable_prefix_caching": True, "block_size": 16},
        "vLLM V1 defaults (vllm/engine/arg_utils.py: chunked prefill and prefix caching on "
        "for models that support them; CacheConfig block_size 16)",
    ),
    SGLANG: (
        {"enable_chunked_prefill": True, "enable_prefix_caching": True, "block_size": 1},
        "SGLang defaults (python/sglang/srt/server_args.py: chunked prefill, radix cache, "
        "page_size 1)",
    ),
    LLAMACPP: (
        {
            "enable_chunked_prefill": True,
            "enable_prefix_caching": True,
            "block_size": 1,
            "prefix_cache_scope": "finished",
        },
        "llama.cpp llama-server defaults (prompts always cut into --batch-size pieces; a "
        "prompt reuses what finished requests left in idle slots and the RAM prompt cache, "
        "never a running request's: tools/server/server.cpp)",
    ),
}

_DEFAULT_MARK = "default: "
# /metrics info-gauge labels that state a setting, under their engine-config names.
_INFO_LABELS = {
    "block_size": "block_size",
    "enable_prefix_caching": "enable_prefix_caching",
    "num_gpu_blocks": "num_kv_blocks",
}


@dataclass
class ServerSettings:
    """``values``: engine-config names -> settings (``kv_tokens``: llama.cpp's KV cache in
    tokens); ``sources``: the same names -> where each value came from; ``command``: the
    launch command read (redacted), if any."""

    kind: str
    values: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    command: list[str] | None = None

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def stated(self, key: str, default: Any = None) -> Any:
        """The setting where the server, its launch command or the user stated it (not an
        engine default)."""
        if self.sources.get(key, "").startswith(_DEFAULT_MARK):
            return default
        return self.values.get(key, default)

    def set_default(self, key: str, value: Any, source: str) -> None:
        if key not in self.values and value is not None:
            self.values[key] = value
            self.sources[key] = source

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "values": self.values,
            "sources": self.sources,
            "command": self.command,
        }


def kind_of_command(argv: list[str]) -> str | None:
    """Which server a launch command starts (``vllm``, ``sglang``, ``llamacpp``), or None."""
    words = [a.rsplit("/", 1)[-1] for a in argv if not a.startswith("-")]
    for kind, names in _PROGRAMS.items():
        if any(w in names for w in words):
            return kind
    return None


def server_kind(run: Run) -> str:
    """Whose flags a run's server takes: ``servelab``, ``vllm``, ``sglang``, ``llamacpp``
    (the server's own ``owned_by`` in ``/v1/models``, the per-request figures its responses
    carried -- vLLM ``metrics``, SGLang ``meta_info``, llama.cpp ``timings`` -- or the command
    it was launched or stated with), or ``other``."""
    if run.target_kind == "servelab":
        return SERVELAB
    models = run.server.get("models") or []
    owners = {str(m.get("owned_by", "")).lower() for m in models if isinstance(m, dict)}
    reported = {str((r.server_timeline or {}).get("reported_by", "")) for r in run.records}
    for kind, (owner, figures) in RECOGNISED.items():
        if owner in owners or any(x.startswith(figures) for x in reported):
            return kind
    for key in ("command", "stated_command"):
        argv = run.server.get(key)
        if isinstance(argv, list):
            named = kind_of_command([str(a) for a in argv])
            if named is not None:
                return named
    return OTHER


def parse_flags(kind: str, argv: list[str] | str) -> dict[str, Any]:
    """The settings a command line (or flags alone) sets, by ``FLAGS[kind]``; flags that
    are not in the table are ignored (the server validates its own)."""
    toks = shlex.split(argv) if isinstance(argv, str) else list(argv)
    table = {name: f for f in FLAGS.get(kind, ()) for name in f.flags}
    out: dict[str, Any] = {}
    i = 0
    while i < len(toks):
        tok, value = toks[i], None
        if "=" in tok and tok.startswith("-"):
            tok, value = tok.split("=", 1)
        negated = tok.startswith("--no-") and f"--{tok[5:]}" in table
        f = table.get(f"--{tok[5:]}" if negated else tok)
        i += 1
        if f is None:
            continue
        if f.kind == "bool":
            out[f.key] = not negated if value is None else value.lower() in ("1", "true")
            continue
        if f.kind == "off":
            out[f.key] = False
            continue
        if value is None and i < len(toks):
            value, i = toks[i], i + 1
        try:
            n = int(value) if value is not None else None
        except ValueError:
            continue
        if f.kind == "value_or_off" and n == f.off_value and f.switch:
            out[f.switch] = False
        elif n is not None:
            out[f.key] = n
            if f.switch:
                out.setdefault(f.switch, True)
    return out


def render_flags(kind: str, changes: dict[str, Any]) -> str:
    """Engine-config settings as ``kind``'s command-line flags (a template's ``{flags}``).

    A setting the server has no flag for is written as nothing where the server always runs
    that way (llama.cpp always cuts prompts into batches), else named in a ValueError
    (llama.cpp cannot turn prompt batching off; SGLang's radix cache is turned on by
    leaving out its flag)."""
    table = {f.key: f for f in FLAGS.get(kind, ())}
    switches = {f.switch: f for f in FLAGS.get(kind, ()) if f.switch}
    fixed = DEFAULTS.get(kind, ({}, ""))[0]
    parts: list[str] = []
    missing: list[str] = []
    for key, v in changes.items():
        f = table.get(key) or switches.get(key)
        if f is None:
            if key not in fixed or fixed[key] != v:
                missing.append(key)
        elif f.kind == "bool":
            parts.append(f.flags[0] if v else f"--no-{f.flags[0][2:]}")
        elif f.kind == "off":
            if v is False:
                parts.append(f.flags[0])
            else:
                missing.append(key)
        elif key == f.switch:
            if v is False:
                parts.append(f"{f.flags[0]} {f.off_value}")
            # on: the budget's own flag (or the server's default) says the chunk size
        else:
            parts.append(f"{f.flags[0]} {int(v)}")
    if missing:
        raise ValueError(
            f"{kind} has no launch flag for {', '.join(sorted(missing))}; set it another way "
            "or leave it out of the candidate"
        )
    return " ".join(parts)


def _reported(run: Run, out: ServerSettings) -> None:
    source = "the server's /metrics info gauges"
    for labels in (run.server.get("info_metrics") or {}).values():
        for label, key in _INFO_LABELS.items():
            if label in labels:
                v = _label(labels[label])
                if v is not None:
                    out.set_default(key, v, source)
    models = [m for m in run.server.get("models") or [] if isinstance(m, dict)]
    for length in [run.server.get("max_model_len")] + [m.get("max_model_len") for m in models]:
        if isinstance(length, int):
            out.set_default("max_model_len", length, "the server's /v1/models")


def _label(v: str) -> Any:
    if v in ("True", "False"):
        return v == "True"
    try:
        return int(v)
    except ValueError:
        return None


def _from_command(out: ServerSettings, argv: list[str], source: str) -> None:
    parsed = parse_flags(out.kind, argv)
    for k, v in parsed.items():
        out.set_default(k, v, source)


def server_settings(run: Run, stated: str | None = None) -> ServerSettings:
    """The run's server settings by the order of the module doc. ``stated``: a launch
    command or flags given now (ranks with the one the run recorded as stated), with its
    secrets already redacted (it is kept in ``command``)."""
    kind = server_kind(run)
    if stated is not None and kind == OTHER:
        kind = kind_of_command(shlex.split(stated)) or OTHER
    out = ServerSettings(kind)
    if kind == SERVELAB:
        for k, v in run.engine_config.items():
            out.set_default(k, v, "the server's resolved engine config")
        return out
    _reported(run, out)
    launched = run.server.get("command") if run.server.get("launched") else None
    if isinstance(launched, list):
        out.command = [str(a) for a in launched]
        _from_command(out, out.command, "the launch command")
    for text, source in (
        (stated, "the stated server config"),
        (run.server.get("stated_command"), "the stated server config (bench --server-config)"),
    ):
        if text:
            argv = shlex.split(text) if isinstance(text, str) else [str(a) for a in text]
            out.command = out.command or argv
            _from_command(out, argv, source)
    if kind in DEFAULTS:
        values, source = DEFAULTS[kind]
        for k, v in values.items():
            out.set_default(k, v, f"{_DEFAULT_MARK}{source}")
    return out


def run_settings(run: Run) -> ServerSettings:
    """:func:`server_settings` of ``run`` as recorded, computed once per loaded run."""
    got = run.derived.get("server_settings")
    if not isinstance(got, ServerSettings):
        got = server_settings(run)
        run.derived["server_settings"] = got
    return got
