#!/usr/bin/env bash
# Figure: ms per forward of the 1.5B's quantized layers (random Q4_K blocks) against rows 1-128, per
# path: dynaspec's vnni operator, PyTorch int4, int8, dense bf16 and llama.cpp's ggml (plain and
# repacked; needs the optional ggml-python) (results/README.md, "Quantized matmul"). Measured on xeon
# (results/xeon/bench_qmatmul.json.gz and .png); about 10 minutes on 2 cores (estimate). No model files needed.
#   bash benchmarks/qmatmul.sh [result-stem]   (default bench-results/qmatmul)
# Writes <stem>.json and <stem>.png.
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0" && exit 0 ;; esac
cd "$(dirname "$0")/.."
stem=${1:-bench-results/qmatmul}
.venv/bin/dynaspec bench qmatmul --result-file "$stem.json" --plot "$stem.png"
