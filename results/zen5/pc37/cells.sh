#!/usr/bin/env bash
# Issue 37: the pair at eight requests as a user runs it, prefix caching on for none and the pair
# alike (`--enable-prefix-caching`: each run starts with the cache empty), HumanEval then MT-Bench
# chat; per-request beside none and K = 1..3, 8 x C prompts, 8 rounds (results/zen5/sweeps37.sh).
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=bench-results/zen5/pc37
mkdir -p "$out"
. results/zen5/sweeps37.sh
cell cached_pair_humaneval_c8 "$pair" humaneval 8 1,2,3 --enable-prefix-caching
cell cached_pair_mtbench_c8 "$pair" mtbench 8 1,2,3 --enable-prefix-caching
