#!/usr/bin/env bash
# Figure: closed-loop concurrency sweeps of the pair, output tok/s of none, fixed K, the batch-level
# goodput rule and per-request K at C = 1, 2, 4, 8 (results/README.md, "Concurrency sweeps", the zen4
# tables), greedy, 128 tokens, 8 x C prompts, 2 rounds:
#   mixed: HumanEval and MT-Bench alternating, configs none,goodput,per-request (zen4/sweep_mixed_10.json)
#   cross: the HumanEval profile on MT-Bench traffic, configs none,K=1,K=3,goodput,per-request
#          (zen4/sweep_cross_mtbench_6.json.gz; its profile, zen4's profile_qwen_pair_humaneval_4.json, is
#          only in history: `git show e12b4e2:results/epyc/profile_qwen_pair_humaneval_4.json`)
# Measured on zen4 (2-core EPYC, Zen 4) with results/zen4/profile_qwen_pair_humaneval_7.json (mixed);
# about 10 (mixed) to 20 (cross) minutes there (estimate). A profile is machine-specific: on another machine pass your own.
#   bash benchmarks/sweep_policies.sh mixed|cross [result-stem] [profile]
#        (default stem bench-results/sweep_<traffic>)
# Writes <stem>.json and <stem>.png.
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0" && exit 0 ;; esac
cd "$(dirname "$0")/.."
traffic=${1:?mixed or cross (--help)}
case "$traffic" in
mixed) args=(--dataset mixed --configs none,goodput,per-request) ;;
cross) args=(--dataset mtbench --configs none,K=1,K=3,goodput,per-request) ;;
*) echo "traffic: mixed or cross, not $traffic" >&2 && exit 2 ;;
esac
stem=${2:-bench-results/sweep_$traffic}
profile=${3:-results/zen4/profile_qwen_pair_humaneval_7.json}
.venv/bin/dynaspec bench sweep --model qwen2.5-coder-1.5b-instruct --speculative-config @results/spec_qwen_pair.json \
    --profile "$profile" "${args[@]}" --concurrency 1,2,4,8 --prompts-per-concurrency 8 --min-prompts 8 \
    --max-tokens 128 --rounds 2 --result-file "$stem.json" --plot "$stem.png"
