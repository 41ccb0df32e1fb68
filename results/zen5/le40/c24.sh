#!/usr/bin/env bash
# The pair's long-context sweep at two and four requests only, warm policies (as run.sh), after K=0's
# cell is timed too when a drafting K is close (_neighbour_to_time): bench sweep --warm-policies on
# longedit, none, K = 1..5, per-request, ctx-blind, 4 rounds of 4 x C prompts, prompts prefilled.
# Writes results/zen5/le40/sweep_pair_longedit_c24.{json,png,log}.
#   bash results/zen5/le40/c24.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=results/zen5/le40 name=sweep_pair_longedit_c24
.venv/bin/dynaspec bench sweep --model qwen2.5-coder-1.5b-instruct \
    --speculative-config '{"method":"draft_model","model":"qwen2.5-coder-0.5b-instruct","num_speculative_tokens":5}' \
    --profile auto --dataset longedit --concurrency 2,4 --prompts-per-concurrency 4 --min-prompts 4 \
    --fixed-ks 1,2,3,4,5 --configs none,K=1,K=2,K=3,K=4,K=5,per-request,ctx-blind --max-tokens 128 --rounds 4 \
    --warm-policies --warm-prompts --kv-cache-memory-gb 4 --result-file "$out/$name.json" --plot "$out/$name.png" \
    > "$out/$name.log" 2>&1
