"""The kernels' other halves on a CPU with more: built for another CPU (`DYNASPEC_KERNEL_MARCH`), the
AVX2 half (on an AVX-512 CPU) and the AVX-512 half without VNNI (on a VNNI CPU: Skylake-SP's
instructions) must match the float reference and stay batch invariant as the native build does.
CI machines without those instructions test each half natively; this keeps every half tested where
the native build is another."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dynaspec.models.kernels import kernel_error, kernel_march

ROOT = Path(__file__).resolve().parents[2]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "flags:")
    return set(line.split(":", 1)[1].split())


# (gcc's CPU name, the half it builds, the native flag without which that half is the native build)
HALVES = [
    pytest.param("x86-64-v3", "avx512bw", id="avx2-half"),
    pytest.param("skylake-avx512", "avx512_vnni", id="avx512-without-vnni"),
]


@pytest.mark.parametrize("march,beyond", HALVES)
def test_another_half_matches_the_reference(march: str, beyond: str, tmp_path: Path) -> None:
    """The quantized matmuls and the attention kernel, built for a CPU with less than this one."""
    if kernel_error() is not None or beyond not in _cpu_flags():
        pytest.skip(f"the native build is this half (no {beyond}) or the kernels are unavailable")
    env = os.environ | {"DYNASPEC_KERNEL_MARCH": march}
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
    # and the same bits as the native build: the integer sums are exact, the epilogue the same
    saved = tmp_path / "outputs.pt"
    done = subprocess.run(
        [sys.executable, __file__, str(saved)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-2000:]
    theirs, ours = torch.load(saved), kernel_outputs()
    assert theirs.keys() == ours.keys()
    for key, value in ours.items():
        assert torch.equal(theirs[key], value), key


def kernel_outputs() -> dict[str, torch.Tensor]:
    """The kernel's outputs for each GGUF type it takes, at row counts that reach each of its loops."""
    from gguf import GGMLQuantizationType as T

    from dynaspec.models.gguf_blocks import decode_blocks, random_blocks
    from dynaspec.models.qlinear import QuantLinear

    shape = (96, 512)
    x = torch.randn(70, shape[1], generator=torch.Generator().manual_seed(7))
    out = {}
    for qtype in (T.Q4_K, T.Q5_K, T.Q6_K, T.Q4_0, T.Q5_0, T.Q8_0):
        layer = QuantLinear(decode_blocks(random_blocks(qtype, shape, int(qtype)), qtype, shape), path="vnni")
        for rows in (1, 2, 3, 4, 5, 8, 17, 70):
            out[f"{qtype.name}/{rows}"] = layer(x[:rows])
    return out


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


if __name__ == "__main__":  # the outputs of this process's build, for the test above
    torch.save(kernel_outputs(), sys.argv[1])
