"""KV-transfer links between prefill and decode replicas (disaggregated serving)."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Link:
    """A point-to-point link: ``bandwidth`` bytes/s one way per device, ``latency`` seconds."""

    name: str
    bandwidth: float
    latency: float
    source: str = ""

    def transfer_time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


# name, bandwidth (bytes/s one way per device), latency (s), where the figures come from
_PRESETS = (
    ("nvlink", 450e9, 5e-6, "NVLink 4 (H100/H200 SXM): 900 GB/s bidirectional per GPU"),
    ("ib", 50e9, 10e-6, "InfiniBand NDR 400 Gb/s per GPU (ConnectX-7), one way"),
    ("roce", 25e9, 20e-6, "RoCE 200 Gb/s per GPU, one way"),
    ("ethernet", 12.5e9, 50e-6, "100 Gb/s Ethernet with TCP, one way"),
    ("pcie", 25e9, 10e-6, "PCIe Gen4 x16 through host memory, about 25 GB/s one way"),
)
LINKS: dict[str, Link] = {
    name: Link(name=name, bandwidth=bandwidth, latency=latency, source=source)
    for name, bandwidth, latency, source in _PRESETS
}

_CUSTOM = re.compile(r"^\s*([0-9.]+)\s*(gb|GB|Gb|gbit|GBps)/s(?:\s*,\s*([0-9.]+)\s*(us|ms))?\s*$")


def parse_link(text: str) -> Link:
    """A preset name (nvlink, ib, roce, ethernet, pcie) or ``"25GB/s,10us"`` / ``"100Gb/s,50us"``.

    ``GB/s`` is bytes, ``Gb/s`` bits. Raises ValueError with the accepted forms.
    """
    key = text.strip().lower()
    if key in LINKS:
        return LINKS[key]
    m = _CUSTOM.match(text)
    if not m:
        raise ValueError(
            f"bad link {text!r}: use one of {', '.join(LINKS)} or a bandwidth with an optional "
            "latency, e.g. '25GB/s,10us' (bytes) or '100Gb/s,50us' (bits)"
        )
    value, unit, lat, lat_unit = m.groups()
    bw = float(value) * 1e9 / (8 if unit in ("Gb", "gbit") else 1)
    latency = float(lat) * (1e-6 if lat_unit == "us" else 1e-3) if lat else 10e-6
    return Link(name=text.strip(), bandwidth=bw, latency=latency, source="custom")
