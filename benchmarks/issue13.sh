#!/usr/bin/env bash
# The issue-13 figures (results/RESULTS.md, "K where the seeds need it"): the mixed-traffic sweep
# (per-request K beside the batch-level goodput policy), the RL-rollout tail, and the cross-dataset
# sweep (profiled on HumanEval, run on MT-Bench). About 50 minutes on the project's 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
D=.venv/bin/dynaspec
MODEL=qwen2.5-coder-1.5b-instruct
SPEC='{"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", "draft_vocab_size": 32768, "num_speculative_tokens": 5}'
PROFILE=results/profile_qwen_pair_humaneval.json
$D bench sweep --model $MODEL --speculative-config "$SPEC" --profile $PROFILE --dataset mixed \
    --concurrency 1,2,4,8 --prompts-per-concurrency 8 --min-prompts 8 --max-tokens 128 --rounds 2 \
    --configs none,K=3,goodput,per-request --result-file results/sweep_mixed.json --plot results/sweep_mixed.png \
    2>&1 | grep -v "it/s]\|s/it]" | tee results/sweep_mixed.log
$D bench rollout --model $MODEL --speculative-config "$SPEC" --profile $PROFILE --dataset mtbench \
    --num-prompts 24 --lengths longtail --median-tokens 48 --max-tokens 192 --rounds 2 --result-file results/bench_rollout.json \
    --plot results/bench_rollout.png 2>&1 | grep -v "it/s]\|s/it]" | tee results/bench_rollout.log
$D bench sweep --model $MODEL --speculative-config "$SPEC" --profile $PROFILE --dataset mtbench \
    --concurrency 1,2,4,8 --prompts-per-concurrency 8 --min-prompts 8 --max-tokens 128 --rounds 2 \
    --configs none,K=1,K=3,K=5,per-request --result-file results/sweep_cross.json --plot results/sweep_cross.png \
    2>&1 | grep -v "it/s]\|s/it]" | tee results/sweep_cross.log
