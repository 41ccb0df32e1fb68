#!/usr/bin/env bash
# The README's main job and its headline figure: 8 code-editing requests (`codeedit`: edit a whole
# HumanEval function, so the answer repeats most of the prompt) submitted at once, a batch that
# thins out as requests finish (a rollout's shape), decoded greedily three ways in interleaved rounds
# on the same prompts: no speculation, n-gram drafts at a fixed K=5, and n-gram drafts whose K the
# engine chooses per request from the load and its own profile ("auto": made on first use, about
# 5 minutes on a 2-core CPU, then cached). Prints the makespans, the speed-up over no speculation in
# each round, none's round-to-round spread and the K chosen at each load; writes the JSON and a plot
# (running requests and K over time).
#   bash benchmarks/main_job.sh [result-stem]   (default bench-results/main_job; 13 min + the profile)
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0" | grep -v '^set -euo' && exit 0 ;; esac
cd "$(dirname "$0")/.."
stem=${1:-bench-results/main_job}
.venv/bin/dynaspec bench rollout --model qwen2.5-coder-1.5b-instruct \
    --speculative-config '{"method": "ngram", "dynamic_config_path": "auto"}' \
    --dataset codeedit --num-prompts 8 --max-tokens 384 --temperature 0 \
    --fixed-ks 5 --policies per-request --rounds 2 \
    --result-file "$stem.json" --plot "$stem.png"
