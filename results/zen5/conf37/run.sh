#!/usr/bin/env bash
# Issue 37: the n-gram's sweeps with confidence stops (per-request) beside stops-off (per-request
# without them: the n-gram before its tokens had a confidence), 4 rounds, 4 x C prompts.
set -euo pipefail
cd "$(dirname "$0")/../../.."
mkdir -p bench-results/zen5/conf37
for dataset in humaneval mtbench; do
    EXTRA_CONFIGS=stops-off ROUNDS=4 PROMPTS_PER_C=4 bash benchmarks/auto_sweep.sh ngram "$dataset" \
        "bench-results/zen5/conf37/sweep_ngram_$dataset" > "bench-results/zen5/conf37/sweep_ngram_$dataset.log" 2>&1
done
