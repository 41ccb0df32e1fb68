"""dynaspec's C++ operators (models/csrc): built with the machine's compiler on first use (the set-up
builds them), cached in torch's extension directory under a name hashed from their sources."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from pathlib import Path

KERNEL_SOURCES = [
    Path(__file__).parent / "csrc" / f
    for f in ("qmatmul.cpp", "attention.cpp", "fused.cpp", "unpack.cpp", "layer.cpp")
]


def kernel_march() -> str:
    """The CPU the kernels are built for: ``-march=native`` unless ``DYNASPEC_KERNEL_MARCH`` names
    another (gcc's names: ``znver3`` builds the AVX2 half on an AVX-512 machine, to measure it there;
    ``x86-64-v3`` for a build that runs on any AVX2 CPU)."""
    return os.environ.get("DYNASPEC_KERNEL_MARCH", "native")


@functools.cache
def kernel_digest() -> str:
    """A hash of the C++ operators' sources (and the target CPU when not native): names their build,
    and keys the cached auto profile (a kernel change changes what each step costs)."""
    hashed = sorted([*KERNEL_SOURCES, *KERNEL_SOURCES[0].parent.glob("*.h")])
    march = b"" if kernel_march() == "native" else kernel_march().encode()
    return hashlib.sha256(b"".join(p.read_bytes() for p in hashed) + march).hexdigest()[:12]


@functools.cache
def kernel_error() -> str | None:
    """None when the C++ operators (quantized matmul, row-wise paged attention, fused norm/RoPE/SiLU)
    are loaded (built on first use, cached in torch's extension directory), else why they are not.
    ``DYNASPEC_KERNELS=0`` in the environment leaves them out (the built-in paths, as on a CPU
    they do not build for)."""
    if os.environ.get("DYNASPEC_KERNELS", "1") == "0":
        return "turned off by DYNASPEC_KERNELS=0"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the C++ kernels need x86-64, not {platform.machine()}"
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    # AVX2 with FMA and F16C at least; the build targets this CPU (-march=native), so AVX-512 VNNI
    # and AMX are used where present (csrc/qmatmul.cpp, qmatmul_avx2.h)
    missing = [flag for flag in ("avx2", "fma", "f16c") if flag not in flags]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    try:
        from torch.utils import cpp_extension

        # named by the sources' hash: two versions of dynaspec (or two checkouts) never rebuild
        # each other's copy in torch's shared extension directory
        cpp_extension.load(
            name=f"dynaspec_kernels_{kernel_digest()}",
            sources=[str(p) for p in KERNEL_SOURCES],
            extra_cflags=["-O3", f"-march={kernel_march()}", "-fopenmp"],  # parallel_for is OpenMP
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # no compiler, any build failure: the built-in paths still work
        return f"building the C++ kernels failed: {type(e).__name__}: {str(e).strip()[-400:]}"
    return None
