"""Building servelab's CPU kernels (``csrc/cpu_kernels.c``); imports no torch.

Contract:
- ``expected()``: whether the kernels should be usable here (x86-64 with AVX2, FMA and F16C, a C
  compiler, ``SERVELAB_CPU_KERNELS`` not ``0``). Cheap: no compilation. ``servelab.model``'s
  ``__init__`` uses it to pick the OpenMP wait policy before torch loads.
- ``isa()``: the instruction set the library is built for: ``"avx512bf16"`` where the CPU
  also has AVX512-BF16 (and -BW, -VL), ``"avx512vnni"`` where it has AVX-512F and AVX512-VNNI,
  ``"avx512"`` with AVX-512F alone, else ``"avx2"``;
  ``SERVELAB_CPU_ISA`` forces a narrower one (the tests run them all). The AVX-512 build
  (``-DSL_AVX512``) widens the fp32 tiles and the dequantisation of quantised blocks to 16
  lanes; the VNNI build (``-DSL_VNNI``) adds integer-dot products for Q4_1 and Q8_0
  weights interleaved by 16 rows (kinds 3 and 4); the BF16 build (``-DSL_BF16``) adds bf16
  products of bf16 weights interleaved by 16 rows (kind 6, ``--quantization bf16``);
  everything else is the same AVX2 code.
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
_ISA_FLAGS = {
    "avx2": [],
    "avx512": ["-mavx512f", "-DSL_AVX512"],
    "avx512vnni": ["-mavx512f", "-DSL_AVX512", "-mavx512vnni", "-DSL_VNNI"],
    "avx512bf16": [
        *["-mavx512f", "-DSL_AVX512", "-mavx512vnni", "-DSL_VNNI"],
        *["-mavx512bw", "-mavx512vl", "-mavx512bf16", "-DSL_BF16"],
    ],
}


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


def _best_isa() -> str:
    flags = _cpu_flags()
    if " avx512f" not in flags:
        return "avx2"
    if " avx512_vnni" not in flags:
        return "avx512"
    bf16 = all(f in flags for f in (" avx512_bf16", " avx512bw", " avx512vl"))
    return "avx512bf16" if bf16 else "avx512vnni"


def isa() -> str:
    best = _best_isa()
    forced = os.environ.get("SERVELAB_CPU_ISA", "").strip().lower()
    if not forced:
        return best
    names = list(_ISA_FLAGS)
    if forced not in names:
        raise RuntimeError(
            f"SERVELAB_CPU_ISA={forced!r}: use one of {', '.join(names)}, or unset it"
        )
    # Only narrower than the CPU has: a wider build would fault on its first instruction.
    return forced if names.index(forced) <= names.index(best) else best


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
