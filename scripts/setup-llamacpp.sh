#!/usr/bin/env bash
# Optional: llama.cpp (llama-cpp-python) as the reference engine of `dynaspec bench decode|spec|
# footprint|perplexity`, built from source for this CPU (10-30 minutes on 2 cores, once: pip keeps
# the wheel in its cache). Never needed by the test suite.
# Built for this CPU's vector extensions (GGML_NATIVE), AMX off: llama-cpp-python 0.3.36 built
# with AMX crashed in llama_decode on an AMX machine, while its AVX-512 weight repacking (its
# fastest path there) works.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
.venv/bin/python -m pip install -e ".[llamacpp]"
