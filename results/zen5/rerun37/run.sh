#!/usr/bin/env bash
# Issue 37: 8-round reruns of the cells the policy (one drift, 47a2b7b's) missed in the A/B
# (results/zen5/ab37): the pair on MT-Bench at C = 2 and 8, on HumanEval at C = 8, and the n-gram on
# MT-Bench at C = 1; per-request beside none and the fixed Ks near it, C prompts a round,
# 8 rounds, 128 tokens, greedy, the auto profiles cached on this machine.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=bench-results/zen5/rerun37
mkdir -p "$out"
. results/zen5/sweeps37.sh
cell sweep_pair_mtbench_c2 "$pair" mtbench 2 1,2,3
cell sweep_ngram_mtbench_c1 "$ngram" mtbench 1 1,2,3
cell sweep_pair_humaneval_c8 "$pair" humaneval 8 1,2
cell sweep_pair_mtbench_c8 "$pair" mtbench 8 1,2
# the last cell again with one policy per configuration kept across its runs (as a server keeps one)
.venv/bin/dynaspec bench sweep --model qwen2.5-coder-1.5b-instruct --speculative-config "$pair" \
    --profile auto --dataset humaneval --concurrency 8 --prompts-per-concurrency 8 --min-prompts 64 \
    --fixed-ks 1,2 --configs none,K=1,K=2,per-request --max-tokens 128 --rounds 8 --warm-policies \
    --result-file "$out/sweep_pair_humaneval_c8_warm.json" > "$out/sweep_pair_humaneval_c8_warm.log" 2>&1
