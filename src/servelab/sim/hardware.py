"""Hardware catalogue for the roofline cost model.

Each entry gives the dense (non-sparse) peak of the datatype the model runs in, the
memory bandwidth, the memory size and the per-device interconnect bandwidth, and
cites where the figures come from. Efficiencies (MFU, MBU) and fixed costs are *not*
hardware facts: they live in :class:`servelab.sim.roofline.Efficiency`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or this CPU) as the roofline sees it.

    ``peak_flops`` is dense FLOP/s in ``dtype``; ``mem_bw`` bytes/s; ``memory_bytes``
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


GB = 1e9
TB = 1e12

HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware(
            name="h100",
            peak_flops=989e12,
            mem_bw=3.35 * TB,
            memory_bytes=80 * GB,
            link_bw=450 * GB,
            link_latency=8e-6,
            dtype="bf16",
            dtype_bytes=2,
            source="NVIDIA H100 Tensor Core GPU datasheet, SXM5: 989 TFLOPS dense BF16 "
            "(1,979 with sparsity), 3.35 TB/s HBM3, 80 GB, NVLink 900 GB/s bidirectional",
        ),
        Hardware(
            name="h200",
            peak_flops=989e12,
            mem_bw=4.8 * TB,
            memory_bytes=141 * GB,
            link_bw=450 * GB,
            link_latency=8e-6,
            dtype="bf16",
            dtype_bytes=2,
            source="NVIDIA H200 Tensor Core GPU datasheet, SXM: 989 TFLOPS dense BF16, "
            "4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s bidirectional",
        ),
        Hardware(
            name="a100",
            peak_flops=312e12,
            mem_bw=2.039 * TB,
            memory_bytes=80 * GB,
            link_bw=300 * GB,
            link_latency=10e-6,
            dtype="bf16",
            dtype_bytes=2,
            source="NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM: 312 TFLOPS dense BF16, "
            "2,039 GB/s HBM2e, NVLink 600 GB/s bidirectional",
        ),
        Hardware(
            name="a100-40gb",
            peak_flops=312e12,
            mem_bw=1.555 * TB,
            memory_bytes=40 * GB,
            link_bw=300 * GB,
            link_latency=10e-6,
            dtype="bf16",
            dtype_bytes=2,
            source="NVIDIA A100 Tensor Core GPU datasheet, 40GB SXM: 312 TFLOPS dense BF16, "
            "1,555 GB/s HBM2, NVLink 600 GB/s bidirectional",
        ),
        Hardware(
            name="l4",
            peak_flops=121e12,
            mem_bw=300 * GB,
            memory_bytes=24 * GB,
            link_bw=32 * GB,
            link_latency=20e-6,
            dtype="bf16",
            dtype_bytes=2,
            source="NVIDIA L4 Tensor Core GPU datasheet: 242 TFLOPS BF16 with sparsity "
            "(121 dense), 300 GB/s GDDR6, 24 GB, PCIe Gen4 x16 (64 GB/s bidirectional)",
        ),
        Hardware(
            name="mi300x",
            peak_flops=1307.4e12,
            mem_bw=5.3 * TB,
            memory_bytes=192 * GB,
            link_bw=448 * GB,
            link_latency=10e-6,
            dtype="bf16",
            dtype_bytes=2,
            source="AMD Instinct MI300X data sheet: 1,307.4 TFLOPS dense BF16, 5.3 TB/s HBM3, "
            "192 GB, 7 Infinity Fabric links at 128 GB/s (896 GB/s aggregate, bidirectional)",
        ),
        Hardware(
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
    )
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
