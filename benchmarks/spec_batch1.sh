#!/usr/bin/env bash
# Figure: speculative decoding at batch 1, greedy, on 4 HumanEval prompts of 128 tokens: plain, the
# pair (0.5B drafter) at K=1..6, n-gram K=4, llama.cpp plain and prompt lookup (results/README.md,
# "Speculative decoding at batch 1"). Measured on zen3 (results/zen3/bench_spec.json; this command),
# zen4 and xeon (the same without --draft-vocab-size, then not yet the default), zen5 and skx; 5 (zen4)
# to 15 (zen3) minutes on 2 cores (estimate; 12 measured on skx). The llama.cpp columns need scripts/setup-llamacpp.sh.
#   bash benchmarks/spec_batch1.sh [result-stem]   (default bench-results/spec_batch1)
# Writes <stem>.json.
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0" && exit 0 ;; esac
cd "$(dirname "$0")/.."
stem=${1:-bench-results/spec_batch1}
.venv/bin/dynaspec bench spec --dataset humaneval --num-prompts 4 --max-tokens 128 --no-hf \
    --draft-vocab-size 32768 --result-file "$stem.json"
