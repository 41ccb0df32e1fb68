#!/usr/bin/env bash
# Issue 37: the sweeps on chat after the grid's drift was split in two parts (7b39a91): the n-gram
# (with stops-off, for the n-gram a second run of per-request) and the pair, 4 rounds, 4 x C prompts.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=bench-results/zen5/drift37
mkdir -p "$out"
EXTRA_CONFIGS=stops-off ROUNDS=4 PROMPTS_PER_C=4 bash benchmarks/auto_sweep.sh ngram mtbench \
    "$out/sweep_ngram_mtbench" > "$out/sweep_ngram_mtbench.log" 2>&1
ROUNDS=4 PROMPTS_PER_C=4 bash benchmarks/auto_sweep.sh pair mtbench \
    "$out/sweep_pair_mtbench" > "$out/sweep_pair_mtbench.log" 2>&1
