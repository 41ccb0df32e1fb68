#!/usr/bin/env bash
# Issue 37: the n-gram's sweeps with each row priced by its match (per-request) beside matches-off
# (priced by acceptance, with confidence stops) and stops-off (neither), 4 rounds, 4 x C prompts.
set -euo pipefail
cd "$(dirname "$0")/../../.."
mkdir -p bench-results/zen5/match37
for dataset in humaneval mtbench; do
    EXTRA_CONFIGS=matches-off,stops-off ROUNDS=4 PROMPTS_PER_C=4 bash benchmarks/auto_sweep.sh ngram "$dataset" \
        "bench-results/zen5/match37/sweep_ngram_$dataset" > "bench-results/zen5/match37/sweep_ngram_$dataset.log" 2>&1
done
