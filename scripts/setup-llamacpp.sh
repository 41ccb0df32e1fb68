#!/usr/bin/env bash
# Optional: llama.cpp (llama-cpp-python) as the reference engine of `dynaspec bench decode|spec|
# footprint|perplexity`, built from source for this CPU (10-30 minutes on 2 cores, once: pip keeps
# the wheel in its cache). Never needed by the test suite.
# Built for this CPU's vector extensions, AMX off: llama-cpp-python 0.3.36 built with AMX crashed in
# llama_decode on an AMX machine (tilezero, an illegal instruction), while its AVX-512 weight
# repacking (its fastest path there) works. GGML_NATIVE compiles with -march=native, which turns
# AMX on whatever GGML_AMX_* say, so on a CPU with AMX the extensions are named one by one instead
# (a wheel built before this change on such a CPU crashes: `pip cache remove llama_cpp_python`).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
common="-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF"
flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
if [[ " $flags " == *" amx_tile "* ]]; then
  isa="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
-DGGML_AVX_VNNI=$(has avx_vnni) -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512vbmi)
-DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16)"
else
  isa="-DGGML_NATIVE=ON"
fi
export CMAKE_ARGS="${CMAKE_ARGS:-$(echo $isa) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF $common}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
.venv/bin/python -m pip install -e ".[llamacpp]"
