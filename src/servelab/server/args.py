"""Server arguments: `servelab serve` flags, validated, and the engine-core config they imply.

Imports nothing heavy: the CLI validates flags before any process or model is started.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from servelab.engine.config import EngineConfig
from servelab.engine.spec.config import parse_speculative_config
from servelab.model.build import default_threads
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


@dataclass
class ServerArgs:
    """Everything `servelab serve` was asked for (vLLM's flag names).

    ``api_key`` stays in the API process: it is never sent to the engine core nor logged.
    """

    model: str = DEFAULT_MODEL
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)
    served_model_name: str | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    kv_cache_memory: str | None = None
    block_size: int | None = None
    max_queue: int | None = None
    device: str | None = None
    threads: int | None = None
    quantization: str = "none"  # servelab.model.quant.MODES
    shutdown_timeout: float = 30.0
    # Limits at the door (docs/design/server.md): OpenAI's 4 stop sequences by default.
    max_stop_sequences: int = 4
    max_body_size: str = "16MiB"
    # Seconds a connection may take to send a complete request head, counted from its
    # opening or from the head's first byte.
    header_timeout: float = 5.0
    # Seconds an idle keep-alive connection stays open: longer than clients' own pools keep
    # one (aiohttp 15 s, httpx and the OpenAI SDK 5 s), so that the client closes it first.
    keep_alive_timeout: float = 30.0
    # Seconds a request's body may take to arrive once its head has: a client that trickles
    # it is answered 408 and closed.
    body_timeout: float = 30.0
    log_level: str = "info"
    simulate: str | None = None  # HARDWARE:MODEL: stream at the simulator's timings
    speculative_config: str | None = None  # vLLM's JSON, e.g. '{"method": "ngram", ...}'
    # Disaggregated prefill/decode (servelab.server.disagg): separate worker processes and KV pools.
    disaggregated: bool = False
    prefill_workers: int = 1
    decode_workers: int = 1
    kv_transport: str = "shm"  # "shm" (one host) or "socket" (TCP, any hosts)
    kv_host: str = "127.0.0.1"  # socket transport: decode workers bind and advertise this
    kv_transfer_timeout: float = 30.0  # seconds for one reservation + transfer
    kv_handoff_timeout: float = 600.0  # seconds a request may wait for decode room

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
        """The engine config these flags ask for (unset flags keep the engine's defaults)."""
        cfg = EngineConfig(
            enable_chunked_prefill=self.enable_chunked_prefill,
            enable_prefix_caching=self.enable_prefix_caching,
            max_queue=self.max_queue,
        )
        if self.max_num_batched_tokens is not None:
            cfg.max_num_batched_tokens = self.max_num_batched_tokens
        if self.max_num_seqs is not None:
            cfg.max_num_seqs = self.max_num_seqs
        if self.max_model_len is not None:
            cfg.max_model_len = self.max_model_len
        if self.block_size is not None:
            cfg.block_size = self.block_size
        if self.num_gpu_blocks_override is not None:
            cfg.num_kv_blocks = self.num_gpu_blocks_override
        if self.kv_cache_memory is not None:
            cfg.kv_cache_memory_gb = parse_size_gb(self.kv_cache_memory)
        if self.speculative_config is not None:
            cfg.speculative_config = parse_speculative_config(self.speculative_config).to_dict()
        return cfg

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
