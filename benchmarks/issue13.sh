#!/usr/bin/env bash
# The issue-13 figures (results/RESULTS.md, "K where the seeds need it"): a HumanEval profile, the
# mixed-traffic sweep (per-request K beside the batch-level goodput policy), the RL-rollout tail,
# and the cross-dataset sweep (profiled on HumanEval, run on MT-Bench).
# THREADS=1 (the default) runs on one pinned core with one torch thread and its own profile (as the
# profile and mixed sweep were run, while the other core served other work); THREADS=2 runs on
# both cores with the 2-thread profile results/profile_qwen_pair_humaneval.json (as the rollout and
# cross-dataset sweep were run). STEPS="rollout sweep_cross" runs some steps. About an hour.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=qwen2.5-coder-1.5b-instruct
SPEC='{"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", "draft_vocab_size": 32768, "num_speculative_tokens": 5}'
if [ "${THREADS:-1}" = 1 ]; then
    export OMP_NUM_THREADS=1
    D="taskset -c 0 .venv/bin/dynaspec"
    PROFILE=results/profile_1thread_humaneval.json
else
    D=".venv/bin/dynaspec"
    PROFILE=results/profile_qwen_pair_humaneval.json
fi
QUIET='it/s]\|s/it]\|part/s]\|s/part]'
SWEEP="--concurrency 1,2,4,8 --prompts-per-concurrency 8 --min-prompts 8 --max-tokens 128 --rounds 2"

profile() {
    $D profile --model $MODEL --speculative-config "$SPEC" --dataset humaneval --batch-sizes 1,2,4,8 \
        --rounds 2 --num-prompts 8 --max-tokens 64 --output $PROFILE \
        --plot results/goodput_1thread_humaneval.png 2>&1 | grep -v "$QUIET" | tee results/profile_1thread.log
}
sweep_mixed() {
    $D bench sweep --model $MODEL --speculative-config "$SPEC" --profile $PROFILE --dataset mixed $SWEEP \
        --configs none,goodput,per-request --result-file results/sweep_mixed.json \
        --plot results/sweep_mixed.png 2>&1 | grep -v "$QUIET" | tee results/sweep_mixed.log
}
rollout() {
    $D bench rollout --model $MODEL --speculative-config "$SPEC" --profile $PROFILE --dataset mtbench \
        --num-prompts 16 --lengths longtail --median-tokens 48 --max-tokens 192 --rounds 1 \
        --result-file results/bench_rollout.json --plot results/bench_rollout.png 2>&1 \
        | grep -v "$QUIET" | tee results/bench_rollout.log
}
sweep_cross() {
    $D bench sweep --model $MODEL --speculative-config "$SPEC" --profile $PROFILE --dataset mtbench $SWEEP \
        --configs none,K=1,K=3,goodput,per-request --result-file results/sweep_cross.json \
        --plot results/sweep_cross.png 2>&1 | grep -v "$QUIET" | tee results/sweep_cross.log
}
for step in ${STEPS:-profile sweep_mixed rollout sweep_cross}; do
    "$step"
done
