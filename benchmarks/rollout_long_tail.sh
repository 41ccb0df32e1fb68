#!/usr/bin/env bash
# Figure: an RL-rollout batch with a long tail, makespan of none, fixed K=1/3/5, the batch-level
# goodput rule and per-request K (results/README.md, "RL-rollout batch", the zen4 rows): 32 HumanEval
# prompts, log-normal lengths (median 128, sigma 1.2, cap 2048), sampled at T=1.0, 2 rounds.
#   pair:  the 1.5B target with its 0.5B drafter (head cut to 32768 ids), profile
#          results/zen4/profile_qwen_pair_humaneval_7.json (runs 13 and 14: bench_rollout_pair_13/14)
#   ngram: n-gram drafting, profile results/zen4/profile_ngram_auto_5.json (bench_rollout_ngram_6)
# Measured on zen4 (2-core EPYC, Zen 4); about 20-25 minutes there (6 configurations x 2 rounds of
# about 90 s, estimate). A profile is machine-specific: on another machine pass your own (`dynaspec profile`, benchmarks/profile_pair.sh).
#   bash benchmarks/rollout_long_tail.sh pair|ngram [result-stem] [profile]
#        (default stem bench-results/rollout_<method>)
# Writes <stem>.json and <stem>.png (the record keeps the JSON gzipped).
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0" && exit 0 ;; esac
cd "$(dirname "$0")/.."
method=${1:?pair or ngram (--help)}
case "$method" in
pair)
    spec='{"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", "draft_vocab_size": 32768, "num_speculative_tokens": 5}'
    profile=${3:-results/zen4/profile_qwen_pair_humaneval_7.json}
    ;;
ngram)
    spec='{"method": "ngram", "num_speculative_tokens": 5}'
    profile=${3:-results/zen4/profile_ngram_auto_5.json}
    ;;
*) echo "method: pair or ngram, not $method" >&2 && exit 2 ;;
esac
stem=${2:-bench-results/rollout_$method}
.venv/bin/dynaspec bench rollout --model qwen2.5-coder-1.5b-instruct --speculative-config "$spec" \
    --profile "$profile" --dataset humaneval --num-prompts 32 --lengths longtail --median-tokens 128 \
    --length-sigma 1.2 --max-tokens 2048 --rounds 2 --result-file "$stem.json" --plot "$stem.png"
