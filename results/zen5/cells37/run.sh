#!/usr/bin/env bash
# Issue 37's four sweeps with per-request (live grid cells) beside cells-off, 4 rounds, 4 x C prompts.
set -euo pipefail
cd "$(dirname "$0")/../../.."
for d in "pair mtbench" "pair humaneval" "ngram humaneval" "ngram mtbench"; do
    set -- $d
    EXTRA_CONFIGS=cells-off ROUNDS=4 PROMPTS_PER_C=4 bash benchmarks/auto_sweep.sh "$1" "$2" \
        "bench-results/zen5/cells37/sweep_$1_$2" > "bench-results/zen5/cells37/sweep_$1_$2.log" 2>&1
done
