"""Server arguments: `servelab serve` flags, validated, and the engine-core config they imply.

Imports nothing heavy: the CLI validates flags before any process or model is started.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any

from servelab.engine.engine_config import EngineConfig, default_threads
from servelab.engine.spec.spec_config import parse_speculative_config
from servelab.engine_flags import config_key, config_settings
from servelab.units import parse_size_gb
from servelab.vocab import DEFAULT_MODEL, check_quantization

API_KEY_ENV = "SERVELAB_API_KEY"

_DISAGG_FLAGS = {  # flag -> ServerArgs field
    "--prefill-workers": "prefill_workers",
    "--decode-workers": "decode_workers",
    "--kv-transport": "kv_transport",
    "--kv-host": "kv_host",
    "--kv-transfer-timeout": "kv_transfer_timeout",
    "--kv-handoff-timeout": "kv_handoff_timeout",
}


def _flag(default: Any, help: str, *, repr: bool = True, **option: Any) -> Any:
    """A `servelab serve` flag: the field, its ``--help`` text and, where typer's defaults do
    not fit, how the option is declared (``decls``, ``envvar``, ``show_default``)."""
    return field(default=default, repr=repr, metadata={"help": help, **option})


@dataclass
class ServerArgs:
    """Everything `servelab serve` was asked for (vLLM's flag names): one field per flag,
    with its help, from which the command's options are generated.

    ``api_key`` stays in the API process: it is never sent to the engine core nor logged.
    """

    model: str = _flag(DEFAULT_MODEL, "Model short name, HF directory or .gguf file.")
    host: str = _flag("127.0.0.1", "Address to bind (loopback by default).")
    port: int = _flag(8000, "Port to bind; 0 picks a free one.")
    api_key: str | None = _flag(
        None,
        f"Require 'Authorization: Bearer KEY' on /v1 routes and POST /reset_prefix_cache "
        f"(or set ${API_KEY_ENV}); /health, /metrics and /version stay open.",
        repr=False,
        envvar=API_KEY_ENV,
        show_default=False,
    )
    served_model_name: str | None = _flag(None, "Name clients pass as 'model' (default: --model).")
    max_num_batched_tokens: int | None = _flag(None, "Token budget of one engine step.")
    max_num_seqs: int | None = _flag(None, "Most sequences in one engine step.")
    max_model_len: int | None = _flag(None, "Context length (default: the model's).")
    enable_chunked_prefill: bool = _flag(True, "Split long prefills.")
    enable_prefix_caching: bool = _flag(True, "Reuse cached prompt blocks.")
    num_gpu_blocks_override: int | None = _flag(
        None, "KV cache size in blocks (overrides --kv-cache-memory)."
    )
    kv_cache_memory: str | None = _flag(
        None, "KV cache size, e.g. 2G or 512MiB (a bare number is GB; default 2)."
    )
    block_size: int | None = _flag(None, "Tokens per KV block.")
    max_queue: int | None = _flag(
        None, "Waiting requests beyond which new ones get 429 with Retry-After."
    )
    device: str | None = _flag(None, "cpu, cuda or cuda:N (default: cuda if present, else cpu).")
    threads: int | None = _flag(
        None,
        "Torch threads of the engine core (default: usable CPUs - 1, at least 1); "
        "with --disaggregated, of each worker (default: see docs/disaggregation.md).",
    )
    quantization: str = _flag(  # servelab.model.quant.MODES
        "none",
        "Weights: none (fp32), bf16 (linear weights and their inputs in bf16, fp32 sums; CPUs "
        "with AVX512-BF16) or q4_1 (the GGUF's own Q4_1 blocks, kept quantised and run on "
        "servelab's CPU kernels).",
    )
    shutdown_timeout: float = _flag(
        30.0, "On SIGTERM, seconds to let in-flight requests finish before aborting them."
    )
    # Limits at the door (docs/design/server.md).
    max_stop_sequences: int = _flag(
        4, "Most stop strings one request may send (OpenAI's limit is 4)."
    )
    max_body_size: str = _flag(
        "16MiB", "Largest request body, e.g. 16MiB or 64M; bigger ones get 413."
    )
    header_timeout: float = _flag(
        5.0,
        "Seconds a connection may take to send a request's headers, from its opening or "
        "from their first byte; a slower one is closed.",
    )
    # Longer than clients' own pools keep an idle connection (aiohttp 15 s, httpx and the
    # OpenAI SDK 5 s), so that the client closes it first.
    keep_alive_timeout: float = _flag(
        30.0,
        "Seconds an idle keep-alive connection stays open (longer than clients' pools "
        "keep one, so that the client closes it first).",
    )
    body_timeout: float = _flag(
        30.0,
        "Seconds a request's body may take to arrive after its headers; a slower one "
        "gets 408 and the connection is closed.",
    )
    log_level: str = _flag("info", "debug, info, warning or error.")
    simulate: str | None = _flag(
        None,
        "Serve the real API with simulated timings, e.g. h200:llama-3.1-8b "
        "(see servelab sim --help).",
    )
    speculative_config: str | None = _flag(
        None,
        'Speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": '
        "4}'; methods: ngram (prompt_lookup_min/max), draft (model), self-draft (num_layers).",
    )
    # Disaggregated prefill/decode (servelab.server.disagg): separate worker processes and KV pools.
    disaggregated: bool = _flag(
        False,
        "Prefill and decode in separate worker processes with their own KV pools.",
        decls=("--disaggregated",),
    )
    prefill_workers: int = _flag(1, "With --disaggregated: prefill workers.")
    decode_workers: int = _flag(1, "With --disaggregated: decode workers.")
    kv_transport: str = _flag(
        "shm", "With --disaggregated: KV transfer by shm (one host) or socket (TCP)."
    )
    kv_host: str = _flag(
        "127.0.0.1", "With --kv-transport socket: address decode workers listen on."
    )
    kv_transfer_timeout: float = _flag(
        30.0, "With --disaggregated: seconds a KV reservation + transfer may take."
    )
    kv_handoff_timeout: float = _flag(
        600.0, "With --disaggregated: seconds a request may wait for decode KV room."
    )

    def __post_init__(self) -> None:
        self.api_key = self.api_key or None  # an empty $SERVELAB_API_KEY means no key
        # Built by the first engine_config() (validate's), then shared: not a field, so
        # it is no flag and dataclasses.replace() builds a new one.
        self._engine_config: EngineConfig | None = None

    @property
    def model_name(self) -> str:
        """The name clients use in ``model`` and /v1/models lists."""
        return self.served_model_name or self.model

    def validate(self) -> None:
        """Raise ValueError naming the flag and saying what works."""
        if not 0 <= self.port <= 65535:
            raise ValueError(
                f"--port {self.port} is out of range: use 0-65535 (0 picks a free port)"
            )
        positive = {
            "--max-num-batched-tokens": self.max_num_batched_tokens,
            "--max-num-seqs": self.max_num_seqs,
            "--max-model-len": self.max_model_len,
            "--num-gpu-blocks-override": self.num_gpu_blocks_override,
            "--block-size": self.block_size,
            "--threads": self.threads,
        }
        for flag, value in positive.items():
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be a positive integer, got {value}")
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0 (0 refuses queueing), got {self.max_queue}")
        if self.kv_cache_memory is not None:
            parse_size_gb(self.kv_cache_memory)
        if self.shutdown_timeout < 0:
            raise ValueError(
                f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout}"
            )
        if self.max_stop_sequences < 0:
            raise ValueError(
                f"--max-stop-sequences must be >= 0 (0 refuses stop), got {self.max_stop_sequences}"
            )
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-size must be at least 1KiB, got {self.max_body_size!r}")
        if not self.header_timeout > 0:
            raise ValueError(
                f"--header-timeout must be a positive number of seconds, got {self.header_timeout}"
            )
        if not self.keep_alive_timeout > 0:
            raise ValueError(
                "--keep-alive-timeout must be a positive number of seconds, "
                f"got {self.keep_alive_timeout}"
            )
        if not self.body_timeout > 0:
            raise ValueError(
                f"--body-timeout must be a positive number of seconds, got {self.body_timeout}"
            )
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError(f"--log-level {self.log_level!r}: use debug, info, warning or error")
        if self.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?|mps", self.device):
            raise ValueError(f"--device {self.device!r} is not known: use cpu, cuda or cuda:N")
        self._validate_disagg()
        check_quantization(self.quantization)
        if self.quantization != "none" and self.disaggregated:
            raise ValueError(
                "--quantization does not work with --disaggregated yet; drop one of them"
            )
        if self.simulate is not None:
            if self.disaggregated:
                raise ValueError("--simulate does not work with --disaggregated; drop one of them")
            from servelab.sim.realtime import build_target

            build_target(self.simulate, self.engine_config())
        if self.speculative_config is not None and self.disaggregated:
            raise ValueError(
                "--speculative-config does not work with --disaggregated yet; drop one of them"
            )
        self.engine_config().validate()

    def _validate_disagg(self) -> None:
        defaults = ServerArgs()
        if not self.disaggregated:
            changed = [
                flag
                for flag, name in _DISAGG_FLAGS.items()
                if getattr(self, name) != getattr(defaults, name)
            ]
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} only apply with --disaggregated; add it or drop them"
                )
            return
        for flag in ("--prefill-workers", "--decode-workers"):
            value = getattr(self, _DISAGG_FLAGS[flag])
            if value < 1:
                raise ValueError(f"{flag} must be at least 1 with --disaggregated, got {value}")
        if self.kv_transport not in ("shm", "socket"):
            raise ValueError(
                f"--kv-transport {self.kv_transport!r}: use shm (one host) or socket (TCP)"
            )
        for flag in ("--kv-transfer-timeout", "--kv-handoff-timeout"):
            value = getattr(self, _DISAGG_FLAGS[flag])
            if not value > 0:
                raise ValueError(f"{flag} must be a positive number of seconds, got {value}")

    def engine_config(self) -> EngineConfig:
        """The engine config these flags ask for (unset flags keep the engine's defaults).

        Built once, by the first call (``validate`` makes it), from the flags as they are
        then; every later call returns that same object, so the API process, the workers and
        the simulated target of one serve share one config. Read it, do not change it."""
        if self._engine_config is None:
            keys = {f.name for f in fields(EngineConfig)}
            flags = {
                f.name: getattr(self, f.name) for f in fields(self) if config_key(f.name) in keys
            }
            settings = config_settings({k: v for k, v in flags.items() if v is not None})
            if self.speculative_config is not None:
                spec = parse_speculative_config(self.speculative_config)
                settings["speculative_config"] = spec.to_dict()
            self._engine_config = EngineConfig(**settings)
        return self._engine_config

    @property
    def max_body_bytes(self) -> int:
        """``--max-body-size`` in bytes."""
        try:
            return int(parse_size_gb(self.max_body_size) * 1e9)
        except ValueError:
            raise ValueError(
                f"--max-body-size {self.max_body_size!r} is not a size: use e.g. 16MiB or 64M"
            ) from None

    @property
    def torch_threads(self) -> int:
        return self.threads or default_threads()
