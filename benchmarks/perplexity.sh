#!/usr/bin/env bash
# Figure: perplexity of the 1.5B target on 8 chunks of 512 tokens of the bundled HumanEval + MT-Bench
# text, GGUF blocks and dense bf16 against llama.cpp on the same file (results/README.md,
# "Perplexity"). Measured on xeon (results/xeon/bench_perplexity.json); a few minutes on 2 cores (estimate).
# The llama.cpp row needs scripts/setup-llamacpp.sh.
#   bash benchmarks/perplexity.sh [result-stem]   (default bench-results/perplexity)
# Writes <stem>.json.
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0" && exit 0 ;; esac
cd "$(dirname "$0")/.."
stem=${1:-bench-results/perplexity}
.venv/bin/dynaspec bench perplexity --result-file "$stem.json"
