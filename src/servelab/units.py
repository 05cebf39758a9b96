"""Shared units and their parsing: durations, sizes, SLOs, warm-up rules, and how a time is
printed. Every command and module that reads ``250ms``, ``2G`` or ``ttft=2s,itl=250ms``, or
prints milliseconds, calls these; they import nothing of servelab.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from servelab.vocab import ClientRecord

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(?:([kmgt])(i)?b?)?\s*$", re.IGNORECASE)
_SIZE_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4}


def parse_size_gb(text: str) -> float:
    """Parse a KV-cache size such as ``2``, ``2G``, ``1.5GB`` or ``512MiB`` into GB (1e9 bytes).

    GB is the unit of ``EngineConfig.kv_cache_memory_gb``. A bare number is GB; ``K/M/G/T``
    (optionally with ``B``) are decimal and ``Ki/Mi/Gi/Ti`` binary. Raises ValueError with an
    example of what works.
    """
    m = _SIZE_RE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(
            f"--kv-cache-memory {text!r} is not a size: use a positive number of GB "
            "or a number with a unit, e.g. 2, 2G, 512MiB"
        )
    unit, binary = (m.group(2) or "").lower(), bool(m.group(3))
    if not unit:
        return float(m.group(1))
    return float(m.group(1)) * (1024 if binary else 1000) ** _SIZE_POWERS[unit] / 1e9


_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "min": 60.0}
_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zµ]+)\s*$")


def parse_duration(text: str, *, what: str = "duration") -> float:
    """``"250ms"`` -> 0.25. A unit is required (s, ms, us, min): bare numbers are ambiguous."""
    m = _DURATION_RE.match(str(text))
    if not m or m.group(2) not in _UNITS:
        raise ValueError(
            f"bad {what} {text!r}: write a number with a unit, e.g. 250ms, 2s, 1.5min "
            f"(units: {', '.join(_UNITS)})"
        )
    return float(m.group(1)) * _UNITS[m.group(2)]


@dataclass(frozen=True)
class SLO:
    """Per-request latency limits in seconds; ``None`` means no limit on that metric.

    A request meets the SLO when it succeeded and every limit holds: ``ttft``,
    ``ttft_intended`` and ``e2e`` against the request's value, ``tpot`` against its
    TPOT (requests with one output token have none and pass), and ``itl`` against the
    request's *largest* inter-token gap (a user sees the worst stall, not the mean).
    """

    ttft: float | None = None
    ttft_intended: float | None = None
    itl: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    KEYS = ("ttft", "ttft_intended", "itl", "tpot", "e2e")

    @classmethod
    def parse(cls, text: str | None) -> SLO:
        """Parse ``"ttft=2s,itl=250ms"``. Empty or None gives an SLO with no limits."""
        if not text or not text.strip():
            return cls()
        limits: dict[str, float] = {}
        for part in text.split(","):
            if not part.strip():
                continue
            key, sep, value = part.partition("=")
            key = key.strip().lower()
            if not sep or key not in cls.KEYS:
                raise ValueError(
                    f"bad SLO item {part.strip()!r}: write METRIC=LIMIT items separated by commas, "
                    f"e.g. ttft=2s,itl=250ms; metrics: {', '.join(cls.KEYS)}"
                )
            limits[key] = parse_duration(value, what=f"SLO limit for {key}")
        return cls(**limits)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SLO:
        """From ``{"ttft": "2s", "itl": 0.25}`` (strings need units, numbers are seconds)."""
        if not d:
            return cls()
        unknown = set(d) - set(cls.KEYS)
        if unknown:
            raise ValueError(f"unknown SLO metric(s) {sorted(unknown)}; use {', '.join(cls.KEYS)}")
        return cls(
            **{
                k: (
                    parse_duration(v, what=f"SLO limit for {k}") if isinstance(v, str) else float(v)
                )
                for k, v in d.items()
                if v is not None
            }
        )

    def merged(self, override: SLO) -> SLO:
        """This SLO with every limit that ``override`` sets replaced by the override's."""
        return SLO(
            **{
                k: getattr(override, k) if getattr(override, k) is not None else getattr(self, k)
                for k in self.KEYS
            }
        )

    @property
    def empty(self) -> bool:
        return all(getattr(self, k) is None for k in self.KEYS)

    def to_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.KEYS if getattr(self, k) is not None}

    def met(self, r: ClientRecord) -> bool:
        if not r.ok:
            return False
        checks: list[tuple[float | None, float | None]] = [
            (self.ttft, r.ttft),
            (self.ttft_intended, r.ttft_intended),
            (self.e2e, r.e2e),
        ]
        for limit, value in checks:
            if limit is not None and (value is None or value > limit):
                return False
        if self.tpot is not None and r.tpot is not None and r.tpot > self.tpot:
            return False
        if self.itl is not None:
            gaps = r.itls
            if gaps and max(gaps) > self.itl:
                return False
        return True


@dataclass(frozen=True)
class Trim:
    """A warm-up or cool-down rule: ``seconds``, a number of ``requests``, or a ``percent`` of them."""

    kind: str = "none"  # "none" | "seconds" | "requests" | "percent"
    value: float = 0.0

    @classmethod
    def parse(cls, text: str | float | None) -> Trim:
        """``None``/``"0"`` -> none; ``"10s"`` -> seconds; ``"20"`` -> requests; ``"5%"`` -> percent."""
        if text is None:
            return cls()
        s = str(text).strip()
        if s in ("", "0", "none"):
            return cls()
        try:
            if s.endswith("%"):
                v = float(s[:-1])
                if not 0 <= v < 100:
                    raise ValueError
                return cls("percent", v)
            if s.isdigit():
                return cls("requests", float(int(s)))
            return cls("seconds", parse_duration(s))
        except ValueError:
            raise ValueError(
                f"bad warm-up/cool-down {text!r}: give seconds with a unit (10s), "
                "a number of requests (20) or a percentage of them (5%)"
            ) from None

    def describe(self) -> str:
        if self.kind == "none":
            return "none"
        if self.kind == "seconds":
            return f"{self.value:g}s"
        if self.kind == "requests":
            return f"{int(self.value)} requests"
        return f"{self.value:g}% of requests"


def fmt_ms(seconds: float | None, digits: int = 1, sep: str = "") -> str:
    """Seconds as milliseconds for a table cell: ``fmt_ms(0.0123)`` -> ``"12.3"``; None -> ``-``.

    ``sep=","`` groups thousands (``"1,234.5"``).
    """
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:{sep}.{digits}f}"
