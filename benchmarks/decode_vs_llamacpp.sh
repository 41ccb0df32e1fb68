#!/usr/bin/env bash
# Figure: plain greedy decode tok/s at batch 1 and 8, dynaspec against llama.cpp on the same GGUF
# file (results/README.md, "Plain decode against llama.cpp", rows "1.5B, bs 1" and "bs 8").
# Measured on zen3 (2-core EPYC, Zen 3; results/zen3/bench_decode.json), zen4 (with --repeats 5),
# xeon, zen5 and skx; about 5 minutes on 2 cores (estimate; 8 measured on skx). The llama.cpp column
# needs scripts/setup-llamacpp.sh.
# The record's other rows add --context 8000 --batch-sizes 1, or --model qwen2.5-coder-0.5b-instruct.
#   bash benchmarks/decode_vs_llamacpp.sh [result-stem]   (default bench-results/decode_vs_llamacpp)
# Writes <stem>.json.
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0" && exit 0 ;; esac
cd "$(dirname "$0")/.."
stem=${1:-bench-results/decode_vs_llamacpp}
.venv/bin/dynaspec bench decode --batch-sizes 1,8 --max-tokens 64 --repeats 3 --result-file "$stem.json"
