#!/usr/bin/env bash
# Create .venv at the repository root and install dynaspec with its test dependencies and Ray Serve.
# CPU machines get the pinned CPU build of PyTorch; set DYNASPEC_TORCH to override
# (e.g. DYNASPEC_TORCH="torch" on a CUDA machine, or "" to keep an installed torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
TORCH_SPEC=${DYNASPEC_TORCH-torch==2.13.0}
if [ -n "$TORCH_SPEC" ]; then
    .venv/bin/python -m pip install -q "$TORCH_SPEC"
fi
.venv/bin/python -m pip install -q -e ".[test,ray]"
# build the C++ kernels (quantized matmul, row-wise attention) now rather than on the first run
.venv/bin/python -c "from dynaspec.models.qlinear import kernel_error as e; print('dynaspec kernels:', e() or 'built')"
