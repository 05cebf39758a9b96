"""Rotary position embeddings: inverse frequencies for each scaling variant, and the table.

Variants follow the names a config can carry (``rope_scaling.rope_type``):
``default``; ``linear`` (positions divided by ``factor``); ``dynamic`` (NTK-aware: HF
changes the base only once a sequence outgrows ``max_position_embeddings``, and servelab
never serves beyond that, so within the served range it is exactly ``default``; this also
keeps cached K/V valid as a sequence grows); ``yarn`` (per-frequency blend of
interpolation and extrapolation plus an attention factor); ``llama3`` (Llama 3.1's
wavelength-banded scaling).

The table is complex (``cos + i sin``, times the attention factor) because the model
keeps each head's rotary pairs adjacent and rotates them with one complex multiply.
"""

from __future__ import annotations

import math

import torch

from servelab.modelcore.config import ModelConfig


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def _yarn(cfg: ModelConfig, s: dict) -> tuple[torch.Tensor, float]:
    dim, base, factor = cfg.head_dim, cfg.rope_theta, float(s["factor"])
    orig = s.get("original_max_position_embeddings") or cfg.max_position_embeddings
    beta_fast, beta_slow = s.get("beta_fast", 32.0), s.get("beta_slow", 1.0)

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    inv = _base_inv_freq(base, dim)
    inv_freq = inv / factor * (1 - extrapolation_weight) + inv * extrapolation_weight
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq, float(attention_factor)


def _llama3(cfg: ModelConfig, s: dict) -> torch.Tensor:
    factor = float(s["factor"])
    low_ff, high_ff = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    orig = s.get("original_max_position_embeddings", 8192)
    inv = _base_inv_freq(cfg.rope_theta, cfg.head_dim)
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = orig / low_ff, orig / high_ff
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (orig / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def inv_freq_and_attention_factor(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """``[head_dim / 2]`` float64 inverse frequencies and the factor on cos/sin."""
    s = cfg.rope_scaling or {}
    kind = cfg.rope_type
    if kind in ("default", "dynamic"):
        return _base_inv_freq(cfg.rope_theta, cfg.head_dim), 1.0
    if kind == "linear":
        return _base_inv_freq(cfg.rope_theta, cfg.head_dim) / float(s["factor"]), 1.0
    if kind == "yarn":
        return _yarn(cfg, s)
    if kind == "llama3":
        return _llama3(cfg, s), 1.0
    raise ValueError(f"unsupported rope scaling {kind!r}")


def rope_table(cfg: ModelConfig, max_len: int, device: torch.device | str) -> torch.Tensor:
    """``[max_len, head_dim / 2]`` complex64: ``attention_factor * exp(i * pos * inv_freq)``."""
    inv_freq, attention_factor = inv_freq_and_attention_factor(cfg)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    table = torch.polar(torch.full_like(angles, attention_factor), angles)
    return table.to(torch.complex64).to(device)
