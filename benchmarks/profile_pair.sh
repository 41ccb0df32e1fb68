#!/usr/bin/env bash
# Figure: the pair's goodput profile on HumanEval: ITL(bs, K) for bs 1-32 and K = 0..5, acceptance per
# draft position, and the derived K table (results/README.md, "Goodput and auto profiles", rows "pair,
# HumanEval"). The sweep and rollout figures read such a profile. Measured on zen3
# (results/zen3/profile_qwen_pair_humaneval.json, 15 min 24 s), zen4 (profile_qwen_pair_humaneval_7.json)
# and xeon (results/profile_qwen_pair_humaneval.json); 15-25 minutes on 2 cores.
#   bash benchmarks/profile_pair.sh [result-stem]   (default bench-results/profile_pair_humaneval)
# Writes <stem>.json and <stem>.png (goodput per K against batch size).
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0" && exit 0 ;; esac
cd "$(dirname "$0")/.."
stem=${1:-bench-results/profile_pair_humaneval}
mkdir -p "$(dirname "$stem")"
.venv/bin/dynaspec profile --model qwen2.5-coder-1.5b-instruct --speculative-config @results/spec_qwen_pair.json \
    --dataset humaneval --batch-sizes 1,2,4,8,16,32 --output "$stem.json" --plot "$stem.png"
