"""Datatypes of a simulated deployment: bytes per weight and per KV element, and the
datatype the matrix multiplies run in.

The rules follow how the GPU engines run each scheme:

- ``bf16``/``fp16``: 2-byte weights, 16-bit tensor-core math.
- ``fp8`` (W8A8, e.g. vLLM/TensorRT-LLM FP8 checkpoints): 1-byte weights, and the
  decoder layers' GEMMs run at the FP8 tensor-core peak. On hardware without FP8 tensor
  cores (A100) engines fall back to weight-only FP8 (vLLM's Marlin kernels): 1-byte
  weights, 16-bit math.
- ``int8``/``int4`` weight-only (GPTQ/AWQ-style, group size 128): fewer weight bytes,
  dequantized into 16-bit math. int4 carries one 16-bit scale per 128 weights.
- Only the decoder layers are quantized; the embedding and the LM head stay 16-bit, as
  in the published FP8/AWQ/GPTQ checkpoints.
- The KV cache stores ``--kv-dtype`` elements (default: 16-bit, vLLM's ``auto``; ``fp8``
  halves it); attention math stays 16-bit.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP_SIZE = 128  # AWQ/GPTQ default quantization group

WEIGHT_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5 + 2.0 / GROUP_SIZE,
}
KV_BYTES: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0}
# The datatype the decoder layers' GEMMs run in, when the hardware has it.
COMPUTE_DTYPE: dict[str, str] = {
    "fp32": "fp32",
    "bf16": "bf16",
    "fp16": "bf16",
    "fp8": "fp8",
    "int8": "bf16",
    "int4": "bf16",
}


def _check(kind: str, name: str, known: dict[str, float]) -> str:
    key = name.strip().lower()
    if key not in known:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(known)}")
    return key


@dataclass(frozen=True)
class Precision:
    """``weights``: the checkpoint's datatype; ``kv``: the KV cache's; ``base``: the
    hardware's 16-bit (or, on this CPU, fp32) datatype that everything else runs in."""

    weights: str
    kv: str
    base: str

    @classmethod
    def parse(cls, dtype: str | None, kv_dtype: str | None, base: str) -> Precision:
        """ValueError lists the known datatypes. ``None`` means the hardware's own."""
        w = _check("dtype", dtype, WEIGHT_BYTES) if dtype else base
        kv = _check("kv-dtype", kv_dtype, KV_BYTES) if kv_dtype else base
        if base == "fp32" and (w != "fp32" or kv != "fp32"):
            raise ValueError(
                "the cpu target runs in fp32 only (the engine has no faster datatype here); "
                "drop --dtype/--kv-dtype or simulate a GPU"
            )
        if base != "fp32" and "fp32" in (w, kv):
            raise ValueError("GPU targets run bf16, fp16, fp8, int8 or int4, not fp32")
        return cls(w, kv, base)

    @property
    def layer_weight_bytes(self) -> float:
        return WEIGHT_BYTES[self.weights]

    @property
    def base_bytes(self) -> float:
        return WEIGHT_BYTES[self.base]

    @property
    def kv_bytes(self) -> float:
        return KV_BYTES[self.kv]

    def gemm_dtype(self, peaks: dict[str, float]) -> str:
        """The decoder GEMMs' datatype on hardware with these peaks (FP8 falls back to
        16-bit math where there is no FP8 peak)."""
        want = COMPUTE_DTYPE[self.weights]
        return want if want in peaks else self.base

    def describe(self) -> dict[str, str | float]:
        return {"dtype": self.weights, "kv_dtype": self.kv, "weight_bytes": self.layer_weight_bytes}
