#!/usr/bin/env bash
# Figure: the README's main command (dynaspec generate, 24 HumanEval chat prompts, 96 tokens) with
# n-gram drafts and the auto profile, beside no speculation and fixed K=5 (results/README.md, "The
# README's main command"). Measured on zen3, zen4 and xeon (the logs in results/zen3/ and
# results/zen4/). The first auto run makes and caches the profile (about 5 minutes on 2 cores, 6 on
# zen3); then each run takes 1-3 minutes. Runs of one configuration differ by up to 10% on a VM.
#   bash benchmarks/readme_main_command.sh [result-stem]   (default bench-results/readme_main)
# Writes <stem>_auto.log, <stem>_none.log and <stem>_k5.log (tok/s on each log's last lines).
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0" && exit 0 ;; esac
cd "$(dirname "$0")/.."
stem=${1:-bench-results/readme_main}
mkdir -p "$(dirname "$stem")"
main=(.venv/bin/dynaspec generate --model qwen2.5-coder-1.5b-instruct --chat --prompts-file humaneval
    --num-prompts 24 --max-tokens 96)
"${main[@]}" --speculative-config '{"method": "ngram", "dynamic_config_path": "auto"}' 2>&1 | tee "${stem}_auto.log"
"${main[@]}" 2>&1 | tee "${stem}_none.log"
"${main[@]}" --speculative-config '{"method": "ngram", "num_speculative_tokens": 5}' 2>&1 | tee "${stem}_k5.log"
