#!/usr/bin/env bash
# Issue 37: the n-gram's sweeps with the match calibration by draft position (7a4b0e9), per-request
# beside a second run of the same policy (stops-off: for the n-gram the same policy, the sweep's
# own noise), 4 rounds, 4 x C prompts; then the chat sweep's eight-request cell in 8 rounds.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=bench-results/zen5/pos37
mkdir -p "$out"
for dataset in mtbench humaneval; do
    EXTRA_CONFIGS=stops-off ROUNDS=4 PROMPTS_PER_C=4 bash benchmarks/auto_sweep.sh ngram "$dataset" \
        "$out/sweep_ngram_$dataset" > "$out/sweep_ngram_$dataset.log" 2>&1
done
