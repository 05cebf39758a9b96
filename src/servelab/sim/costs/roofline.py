"""Roofline cost model: step time from FLOPs and bytes of a Llama-family step.

Per step (per device, tensor parallel degree ``tp``), the matrix multiplies and the
attention kernels are separate kernels that run one after the other, so each is bounded by
its own roofline and their times add::

    gemm  = max((2 * layer_params * tokens + 2 * hidden * vocab * logits) / gemm_peak / mfu,
                weight_bytes / (bandwidth * mbu))      # q/k/v/o, gated MLP, LM head
    attn  = max(4 * layers * heads * head_dim * attn_pairs / base_peak / mfu,
                kv_bytes_per_token * (kv_read + tokens) / (bandwidth * mbu))  # KV read + write
    time  = gemm + attn
          + 2 * layers * allreduce(tokens * hidden)    # tensor parallel, ring
          + step_overhead + layers * layer_overhead
          + seqs * (seq_overhead + layers * seq_layer_overhead)

``weight_bytes`` are the weights a step streams: the decoder layers, the final norm and the
LM head (the input embedding is a lookup of a few rows, not a read of the table).
FLOPs and bytes divide by ``tp`` (heads and MLP columns split; KV heads replicated
when fewer than ``tp``). The datatypes (:class:`~servelab.sim.costs.dtypes.Precision`) set the
bytes per layer weight and KV element and the peak the decoder GEMMs run at (FP8 W8A8 at
the FP8 peak; weight-only int8/int4 and everything else at the 16-bit peak). The
efficiencies and fixed costs are stated, adjustable parameters (:class:`Efficiency`);
``servelab.sim.fit.calibrate`` fits them to a measured run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from servelab.sim.costs.dtypes import Precision
from servelab.sim.costs.hardware import Hardware
from servelab.sim.costs.model_shapes import ModelSpec
from servelab.sim.costs.work import StepWork


@dataclass
class Efficiency:
    """How far below the hardware peaks a real engine runs, plus fixed costs (seconds).

    Defaults are typical of a well-tuned GPU engine with CUDA graphs: about half the
    dense peak in large GEMMs and three quarters of the bandwidth in decode.
    ``seq_layer_overhead`` is paid per sequence per layer (the per-sequence work of the
    attention and its metadata in every layer, beyond the KV bytes it reads).
    """

    mfu: float = 0.5
    mbu: float = 0.75
    step_overhead: float = 1.0e-3
    layer_overhead: float = 5e-6
    seq_overhead: float = 0.0
    seq_layer_overhead: float = 0.0

    def validate(self) -> None:
        if not (0 < self.mfu <= 1 and 0 < self.mbu <= 1):
            raise ValueError(f"mfu and mbu must be in (0, 1], got {self.mfu}, {self.mbu}")
        fixed = (self.step_overhead, self.layer_overhead, self.seq_overhead)
        if min(*fixed, self.seq_layer_overhead) < 0:
            raise ValueError("fixed costs must be >= 0 seconds")

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass
class StepBreakdown:
    """The terms of one predicted step (seconds, FLOPs, bytes), for explanation and tests.

    ``gemm_*`` are the matrix multiplies (weights streamed), ``attn_*`` the attention
    kernels (KV streamed); each pair is one kernel class's compute and memory roofline.
    """

    flops: float
    bytes: float
    gemm_compute: float
    gemm_memory: float
    attn_compute: float
    attn_memory: float
    comm_time: float
    fixed_time: float

    @property
    def compute_time(self) -> float:
        return self.gemm_compute + self.attn_compute

    @property
    def memory_time(self) -> float:
        return self.gemm_memory + self.attn_memory

    @property
    def time(self) -> float:
        return _step_time(
            self.gemm_compute,
            self.gemm_memory,
            self.attn_compute,
            self.attn_memory,
            self.comm_time,
            self.fixed_time,
        )

    @property
    def bound(self) -> str:
        """Which roofline the larger kernel class sits on."""
        gemm = max(self.gemm_compute, self.gemm_memory)
        attn = max(self.attn_compute, self.attn_memory)
        if gemm >= attn:
            return "compute" if self.gemm_compute >= self.gemm_memory else "memory"
        return "compute" if self.attn_compute >= self.attn_memory else "memory"


class RooflineCostModel:
    """Predicts step times of ``model`` on ``tp`` devices of ``hardware``.

    ``precision`` defaults to the hardware's datatype (bf16 on GPUs, fp32 on this CPU).
    """

    def __init__(
        self,
        model: ModelSpec,
        hardware: Hardware,
        tp: int = 1,
        efficiency: Efficiency | None = None,
        precision: Precision | None = None,
    ) -> None:
        if tp < 1:
            raise ValueError(f"tensor parallel degree must be >= 1, got {tp}")
        self.model = model
        self.hardware = hardware
        self.tp = tp
        self.efficiency = efficiency or Efficiency()
        self.efficiency.validate()
        p = precision or Precision.parse(None, None, hardware.dtype)
        self.precision = p
        self.kv_dtype_bytes = p.kv_bytes
        self.gemm_dtype = p.gemm_dtype(hardware.peaks)
        m = model
        # Per-device constants, computed once: the simulator calls predict() per step.
        self._lin_flops_per_token = m.flops_per_token / tp
        self._attn_flops_per_pair = m.flops_per_attn_pair / tp
        self._head_flops_per_logit = m.flops_per_logit / tp
        # Layer FLOPs at an FP8 peak cost what fewer FLOPs at the 16-bit peak would: one
        # scale keeps a single division per step (exactly 1.0 when both peaks agree).
        self._gemm_scale = hardware.peak_flops / hardware.peaks[self.gemm_dtype]
        self._weight_bytes_per_device = (
            m.linear_params_per_token * p.layer_weight_bytes
            + (m.num_params - m.linear_params_per_token) * p.base_bytes
        ) / tp
        # What a step streams: the layers, the final norm and the LM head, not the input
        # embedding table (tied embeddings are read once, as the LM head).
        self._streamed_weight_bytes = (
            m.linear_params_per_token * p.layer_weight_bytes
            + (m.streamed_params - m.linear_params_per_token) * p.base_bytes
        ) / tp
        self._kv_per_token = self.kv_bytes_per_token_per_device
        self._act_bytes_per_token = m.hidden * hardware.dtype_bytes

    @property
    def name(self) -> str:
        return f"roofline:{self.hardware.name}:{self.model.name}:tp{self.tp}"

    @property
    def kv_bytes_per_token_per_device(self) -> float:
        """KV bytes one device holds per token: KV heads split over ``tp``, at least one each."""
        m = self.model
        kv_heads = max(1.0, m.kv_heads / self.tp)
        return 2 * m.layers * kv_heads * m.head_dim * self.kv_dtype_bytes

    def allreduce_time(self, nbytes: float) -> float:
        """Ring all-reduce of ``nbytes`` over ``tp`` devices (0 without tensor parallelism)."""
        if self.tp == 1:
            return 0.0
        hw = self.hardware
        return 2 * (self.tp - 1) / self.tp * nbytes / hw.link_bw + hw.link_latency

    def cost(self, w: StepWork) -> StepBreakdown:
        return StepBreakdown(*self._terms(w.tokens, w.logits, w.attn_pairs, w.kv_read, w.seqs))

    def _terms(
        self, tokens: int, logits: int, attn_pairs: float, kv_read: int, seqs: int
    ) -> tuple[float, float, float, float, float, float, float, float]:
        """:class:`StepBreakdown`'s fields, in order, as a tuple, from the sums of
        :class:`StepWork` that the roofline reads: ``predict`` runs every simulated step
        and needs no object."""
        e, hw = self.efficiency, self.hardware
        layers = self._lin_flops_per_token * tokens
        head = self._head_flops_per_logit * logits
        attn = self._attn_flops_per_pair * attn_pairs
        kv = self._kv_per_token * (kv_read + tokens)
        # allreduce_time is 0.0 without tensor parallelism: no call on each step then
        comm = (
            2 * self.model.layers * self.allreduce_time(tokens * self._act_bytes_per_token)
            if self.tp > 1
            else 0.0
        )
        peak, bw = hw.peak_flops * e.mfu, hw.mem_bw * e.mbu
        return (
            layers + head + attn,
            self._streamed_weight_bytes + kv,
            (layers * self._gemm_scale + head) / peak,
            self._streamed_weight_bytes / bw,
            attn / peak,
            kv / bw,
            comm,
            e.step_overhead
            + self.model.layers * (e.layer_overhead + seqs * e.seq_layer_overhead)
            + seqs * e.seq_overhead,
        )

    def predict(self, w: StepWork) -> float:
        """Step time in seconds (``cost(w).time``)."""
        terms = self._terms(w.tokens, w.logits, w.attn_pairs, w.kv_read, w.seqs)
        return _step_time(*terms[2:])

    def decode_time(self, num_seqs: int, context_tokens: int) -> float:
        """``predict(decode_work(num_seqs, context_tokens))``: the same float operations, in
        the same order, as ``_terms`` and ``_step_time`` for that work (tests hold the two
        equal), without the work, the terms' tuple or the calls. The simulator's decode
        bursts price every step with this: half a million steps in a long replay."""
        e, hw, n = self.efficiency, self.hardware, num_seqs
        kv_read = context_tokens + n
        layers = self._lin_flops_per_token * n
        head = self._head_flops_per_logit * n
        attn = self._attn_flops_per_pair * float(kv_read)
        kv = self._kv_per_token * (kv_read + n)
        peak, bw = hw.peak_flops * e.mfu, hw.mem_bw * e.mbu
        # max(a, b) spelled out (``b if b > a else a`` is what max returns): two calls a step
        gemm_c, gemm_m = (layers * self._gemm_scale + head) / peak, self._streamed_weight_bytes / bw
        attn_c, attn_m = attn / peak, kv / bw
        t = (gemm_m if gemm_m > gemm_c else gemm_c) + (attn_m if attn_m > attn_c else attn_c)
        if self.tp > 1:
            t += 2 * self.model.layers * self.allreduce_time(n * self._act_bytes_per_token)
        return t + (
            e.step_overhead
            + self.model.layers * (e.layer_overhead + n * e.seq_layer_overhead)
            + n * e.seq_overhead
        )

    def kv_capacity_tokens(
        self, gpu_memory_utilization: float = 0.9, activation_reserve_bytes: float = 1e9
    ) -> int:
        """KV tokens that fit per replica: (memory * utilization - weights - reserve) / KV bytes.

        Raises ValueError when the weights do not fit, naming what to change.
        """
        free = self.kv_memory_bytes(gpu_memory_utilization, activation_reserve_bytes)
        return int(free // self._kv_per_token)

    def kv_memory_bytes(
        self, gpu_memory_utilization: float = 0.9, activation_reserve_bytes: float = 1e9
    ) -> float:
        """Per-device bytes left for the KV cache."""
        mem = self.hardware.memory_bytes
        if mem is None:
            raise ValueError(
                f"{self.hardware.name} has no fixed memory size; size the KV cache with "
                "--engine-args 'kv_cache_memory_gb=...' instead"
            )
        free = (
            mem * gpu_memory_utilization - self._weight_bytes_per_device - activation_reserve_bytes
        )
        if free <= 0:
            raise ValueError(
                f"{self.model.name} in {self.precision.weights} "
                f"({self._weight_bytes_per_device / 1e9:.1f} GB of weights per device at "
                f"tp={self.tp}) does not fit on {self.hardware.name}: {mem / 1e9:.0f} GB x "
                f"{gpu_memory_utilization:g} memory fraction - "
                f"{activation_reserve_bytes / 1e9:.1f} GB reserve leaves "
                f"{free / 1e9:.1f} GB for the KV cache; raise --tp, pick a smaller --dtype "
                "or larger hardware"
            )
        return free

    def describe(self) -> dict:
        return {
            "kind": "roofline",
            "hardware": self.hardware.name,
            "hardware_source": self.hardware.source,
            "model": self.model.name,
            "tp": self.tp,
            **self.precision.describe(),
            "gemm_dtype": self.gemm_dtype,
            "gemm_peak_flops": self.hardware.peaks[self.gemm_dtype],
            "kv_dtype_bytes": self.kv_dtype_bytes,
            "efficiency": self.efficiency.to_dict(),
        }


def _step_time(
    gemm_compute: float,
    gemm_memory: float,
    attn_compute: float,
    attn_memory: float,
    comm_time: float,
    fixed_time: float,
) -> float:
    """Each kernel class on its own roofline, one after the other, then communication and
    fixed costs."""
    return max(gemm_compute, gemm_memory) + max(attn_compute, attn_memory) + comm_time + fixed_time
