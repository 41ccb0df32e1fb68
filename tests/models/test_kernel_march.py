"""The kernels' AVX2 half on a CPU with AVX-512: built for another CPU (`DYNASPEC_KERNEL_MARCH`), it
must match the float reference and stay batch invariant as the native build does. CI machines
without AVX-512 test that half natively; this keeps it tested where the native build is the other."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynaspec.models.kernels import kernel_error, kernel_march

ROOT = Path(__file__).resolve().parents[2]


def _avx512() -> bool:
    try:
        return " avx512_vnni " in f" {Path('/proc/cpuinfo').read_text()} "
    except OSError:
        return False


@pytest.mark.skipif(kernel_error() is not None or not _avx512(), reason="the native build is the AVX2 half")
def test_the_avx2_half_matches_the_reference_on_an_avx512_cpu() -> None:
    """The quantized matmuls and the attention kernel, built for AVX2 only."""
    env = os.environ | {"DYNASPEC_KERNEL_MARCH": "x86-64-v3"}
    selection = "(reference and vnni) or batch_invariant or off_the_amx or float64_reference or bitwise"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/models/test_qlinear.py",
            "tests/models/test_attention_kernel.py",
            "-k",
            selection,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


def test_the_target_cpu_names_the_build(monkeypatch) -> None:
    from dynaspec.models import kernels

    assert kernel_march() == os.environ.get("DYNASPEC_KERNEL_MARCH", "native")
    kernels.kernel_digest.cache_clear()
    monkeypatch.setenv("DYNASPEC_KERNEL_MARCH", "native")
    native = kernels.kernel_digest()
    kernels.kernel_digest.cache_clear()
    monkeypatch.setenv("DYNASPEC_KERNEL_MARCH", "x86-64-v3")
    other = kernels.kernel_digest()
    kernels.kernel_digest.cache_clear()
    assert native != other
