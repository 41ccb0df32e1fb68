#!/usr/bin/env bash
# Issue 37: 8-round reruns of the cells the 8-round sweeps (run.sh) missed: the pair on MT-Bench at
# C = 1 and 4, the n-gram on MT-Bench at C = 4 (per-request beside none and K = 1..3, 8 x C prompts,
# 8 rounds, the fresh auto profiles run.sh made).
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=bench-results/zen5/final37
. results/zen5/sweeps37.sh
cell rerun_pair_mtbench_c1 "$pair" mtbench 1 1,2,3
cell rerun_pair_mtbench_c4 "$pair" mtbench 4 1,2,3
cell rerun_ngram_mtbench_c4 "$ngram" mtbench 4 1,2,3
