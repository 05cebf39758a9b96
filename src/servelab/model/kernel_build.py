"""Building servelab's CPU kernels (``csrc/cpu_kernels.c``); imports no torch.

Contract:
- ``expected()``: whether the kernels should be usable here (x86-64 with AVX2, FMA and F16C, a C
  compiler, ``SERVELAB_CPU_KERNELS`` not ``0``). Cheap: no compilation. ``servelab``'s
  ``__init__`` uses it to pick the OpenMP wait policy before torch loads.
- ``isa()``: the instruction set the library is built for: ``"avx512"`` where the CPU has
  AVX-512F, else ``"avx2"``; ``SERVELAB_CPU_ISA=avx2`` forces the AVX2 build (the tests run
  both). The AVX-512 build (``-DSL_AVX512``) widens the fp32 tiles and the dequantisation of
  quantised blocks to 16 lanes; everything else is the same AVX2 code.
- ``build()``: the path of the compiled library, compiling it once per source version and
  instruction set into ``$SERVELAB_CACHE_DIR/kernels`` (default ``~/.cache/servelab/kernels``).
  Raises RuntimeError with the compiler's message when that fails, or for an unknown
  ``SERVELAB_CPU_ISA``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

_SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared"]
_ISA_FLAGS = {"avx2": [], "avx512": ["-mavx512f", "-DSL_AVX512"]}


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_flags() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_supported() -> bool:
    flags = _cpu_flags()
    return " avx2" in flags and " fma" in flags and " f16c" in flags


def isa() -> str:
    forced = os.environ.get("SERVELAB_CPU_ISA", "").strip().lower()
    if forced:
        if forced not in _ISA_FLAGS:
            raise RuntimeError(f"SERVELAB_CPU_ISA={forced!r}: use avx2, or unset it")
        if forced == "avx2":
            return forced
    return "avx512" if " avx512f" in _cpu_flags() else "avx2"


def wanted() -> bool:
    """Not switched off (``SERVELAB_CPU_KERNELS=0``) and a CPU they run on."""
    return os.environ.get("SERVELAB_CPU_KERNELS", "1") != "0" and cpu_supported()


def expected() -> bool:
    return wanted() and _compiler() is not None


def build() -> Path:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC or install gcc)")
    flags = _FLAGS + _ISA_FLAGS[isa()]
    src = _SOURCE.read_bytes()
    digest = hashlib.sha256(src + " ".join([cc, *flags]).encode()).hexdigest()[:16]
    root = os.environ.get("SERVELAB_CACHE_DIR") or Path.home() / ".cache" / "servelab"
    out = Path(root) / "kernels" / f"cpu_kernels-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *flags, "-o", tmp, str(_SOURCE), "-lm"],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(tmp, out)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{cc} failed: {e.stderr.strip()[-500:]}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
