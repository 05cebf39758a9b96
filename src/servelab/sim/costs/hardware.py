"""Hardware catalogue for the roofline cost model.

Each entry gives the dense (non-sparse) peak per datatype the tensor cores run (16-bit,
and FP8 where the datasheet gives it), the memory bandwidth, the memory size and the per-device interconnect bandwidth, and
cites where the figures come from. Efficiencies (MFU, MBU) and fixed costs are *not*
hardware facts: they live in :class:`servelab.sim.costs.roofline.Efficiency`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or this CPU) as the roofline sees it.

    ``peak_flops`` is dense FLOP/s in ``dtype`` (the 16-bit datatype on GPUs);
    ``fp8_flops`` the dense FP8 peak, None where the hardware has no FP8 tensor cores; ``mem_bw`` bytes/s; ``memory_bytes``
    the device memory (None: the engine's ``kv_cache_memory_gb`` sizes the KV pool,
    as the real engine does on a CPU); ``link_bw`` bytes/s one direction per device
    for tensor-parallel all-reduce; ``link_latency`` seconds per all-reduce.
    """

    name: str
    peak_flops: float
    mem_bw: float
    memory_bytes: float | None
    link_bw: float
    link_latency: float
    dtype: str
    dtype_bytes: int
    source: str
    fp8_flops: float | None = None

    @property
    def peaks(self) -> dict[str, float]:
        """Dense FLOP/s by the datatype the GEMMs run in."""
        out = {self.dtype: self.peak_flops}
        if self.fp8_flops is not None:
            out["fp8"] = self.fp8_flops
        return out


GB = 1e9
TB = 1e12

# The GPUs, all in bf16: dense 16-bit FLOP/s, dense FP8 FLOP/s (None: no FP8 tensor cores),
# memory bandwidth, memory, interconnect bandwidth one way per device, seconds per all-reduce.
_GPUS: dict[str, tuple[float, float | None, float, float, float, float]] = {
    "h100": (989e12, 1979e12, 3.35 * TB, 80 * GB, 450 * GB, 8e-6),
    "h200": (989e12, 1979e12, 4.8 * TB, 141 * GB, 450 * GB, 8e-6),
    "b200": (2.25e15, 4.5e15, 8 * TB, 180 * GB, 900 * GB, 8e-6),
    "a100": (312e12, None, 2.039 * TB, 80 * GB, 300 * GB, 10e-6),
    "a100-40gb": (312e12, None, 1.555 * TB, 40 * GB, 300 * GB, 10e-6),
    "l4": (121e12, 242.5e12, 300 * GB, 24 * GB, 32 * GB, 20e-6),
    "l40s": (362.05e12, 733e12, 864 * GB, 48 * GB, 32 * GB, 20e-6),
    "mi300x": (1307.4e12, 2614.9e12, 5.3 * TB, 192 * GB, 448 * GB, 10e-6),
}
# Where each GPU's figures come from.
_DATASHEETS = {
    "h100": "NVIDIA H100 Tensor Core GPU datasheet, SXM5: 989 TFLOPS dense BF16 "
    "(1,979 with sparsity), 1,979 dense FP8 (3,958 with sparsity), 3.35 TB/s HBM3, "
    "80 GB, NVLink 900 GB/s bidirectional",
    "h200": "NVIDIA H200 Tensor Core GPU datasheet, SXM: 989 TFLOPS dense BF16, "
    "1,979 dense FP8 (3,958 with sparsity), 4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s "
    "bidirectional",
    "b200": "NVIDIA DGX B200 datasheet, 8 GPUs: 72 PFLOPS FP8 and 36 PFLOPS FP16/BF16 "
    "with sparsity, 1,440 GB HBM3e at 64 TB/s, NVLink 5 at 1.8 TB/s bidirectional per "
    "GPU; per GPU dense: 4.5 PFLOPS FP8, 2.25 BF16, 180 GB, 8 TB/s",
    "a100": "NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM: 312 TFLOPS dense BF16, "
    "2,039 GB/s HBM2e, NVLink 600 GB/s bidirectional",
    "a100-40gb": "NVIDIA A100 Tensor Core GPU datasheet, 40GB SXM: 312 TFLOPS dense BF16, "
    "1,555 GB/s HBM2, NVLink 600 GB/s bidirectional",
    "l4": "NVIDIA L4 Tensor Core GPU datasheet: 242 TFLOPS BF16 with sparsity "
    "(121 dense), 485 FP8 with sparsity (242.5 dense), 300 GB/s GDDR6, 24 GB, PCIe "
    "Gen4 x16 (64 GB/s bidirectional)",
    "l40s": "NVIDIA L40S datasheet: 362.05 TFLOPS BF16/FP16 tensor dense (733 with "
    "sparsity), 733 FP8 dense (1,466 with sparsity), 864 GB/s GDDR6, 48 GB, PCIe Gen4 "
    "x16 (64 GB/s bidirectional), no NVLink",
    "mi300x": "AMD Instinct MI300X data sheet: 1,307.4 TFLOPS dense BF16, 2,614.9 dense "
    "FP8, 5.3 TB/s HBM3, 192 GB, 7 Infinity Fabric links at 128 GB/s (896 GB/s "
    "aggregate, bidirectional)",
}

HARDWARE: dict[str, Hardware] = {
    **{
        name: Hardware(
            name=name,
            peak_flops=peak,
            mem_bw=mem_bw,
            memory_bytes=memory,
            link_bw=link_bw,
            link_latency=latency,
            dtype="bf16",
            dtype_bytes=2,
            source=_DATASHEETS[name],
            fp8_flops=fp8,
        )
        for name, (peak, fp8, mem_bw, memory, link_bw, latency) in _GPUS.items()
    },
    "cpu": Hardware(
        name="cpu",
        peak_flops=125e9,
        mem_bw=17 * GB,
        memory_bytes=None,
        link_bw=15 * GB,
        link_latency=5e-6,
        dtype="fp32",
        dtype_bytes=4,
        source="measured on this 2-core AMD EPYC (AVX2), docs/reference-figures.md: fp32 "
        "GEMM 70-125 GFLOP/s, streaming read 16-18 GB/s; fp32 because bf16 has no hardware",
    ),
}


def get_hardware(name: str) -> Hardware:
    """Look up a catalogue entry by name (case-insensitive).

    Raises ValueError listing the known names.
    """
    key = name.strip().lower().replace("_", "-")
    aliases = {"h100-sxm": "h100", "a100-80gb": "a100", "h200-sxm": "h200", "a10040gb": "a100-40gb"}
    key = aliases.get(key, key)
    if key not in HARDWARE:
        raise ValueError(
            f"unknown hardware {name!r}; known: {', '.join(sorted(HARDWARE))}. "
            "Use one of these names (e.g. --hardware h200)."
        )
    return HARDWARE[key]
