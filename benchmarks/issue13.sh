#!/usr/bin/env bash
# The issue-13 figures (results/RESULTS.md, "K where the seeds need it"): a HumanEval profile, the
# mixed-traffic sweep (per-request K beside the batch-level goodput policy), the RL-rollout tail,
# and the cross-dataset sweep (profiled on HumanEval, run on MT-Bench); rollout64, rollout_ngram,
# sweep_mixed_t1, rollout_code, profile_mtbench, sweep_cross_reverse (profiled on MT-Bench, run on
# HumanEval), sweep_cross_reverse_t1 and sweep_cross_t1 (both directions sampled at temperature 1.0)
# came later (all with THREADS=2; results/profile_ngram_auto.json is the n-gram profile that
# `dynamic_config_path: "auto"` cached at 2 threads; the mixed sweeps' first figures predate 812d2ab
# and lie in results/before_scaled_decline/, their re-run at c37cb01 in results/; sweep_c2_t1
# repeats the sampled cross sweeps at C=2 with 4 rounds and sweep_c2_t1_long with 20 x C prompts,
# sweep_c148_t1_long the other concurrencies with 20 x C; rollout64_catchup measures the drafter's
# catch-up in the step budget; rollout_code_window runs rollout_code's policies with and without a
# draft context window; sweep_mixed_ngram the mixed sweep with n-gram drafting).
# THREADS=1 (the default) runs on one pinned core with one torch thread and its own profile (as the
# profile and mixed sweep were run, while the other core served other work); THREADS=2 runs on
# both cores with the 2-thread profile results/profile_qwen_pair_humaneval.json (as the rollout and
# cross-dataset sweep were run). STEPS="rollout sweep_cross" runs some steps. About an hour.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=qwen2.5-coder-1.5b-instruct
PAIR='{"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", "draft_vocab_size": 32768, "num_speculative_tokens": 5}'
SPEC="${SPEC:-$PAIR}"  # SPEC=@results/spec_qwen_pair_int4.json: another drafter configuration
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
rollout64() {  # the issue's default batch: 64 prompts, a longer tail (max 512 tokens)
    $D bench rollout --model $MODEL --speculative-config "$SPEC" --profile $PROFILE --dataset mtbench \
        --num-prompts 64 --lengths longtail --median-tokens 48 --max-tokens 512 --rounds 1 \
        --result-file results/bench_rollout64.json --plot results/bench_rollout64.png 2>&1 \
        | grep -v "$QUIET" | tee results/bench_rollout64.log
}
rollout_ngram() {  # n-gram drafting (the README's method) on code prompts, with its auto profile
    $D bench rollout --model $MODEL --speculative-config '{"method": "ngram", "num_speculative_tokens": 5}' \
        --profile results/profile_ngram_auto.json --dataset humaneval \
        --num-prompts 64 --lengths longtail --median-tokens 48 --max-tokens 512 --rounds 2 \
        --result-file results/bench_rollout_ngram.json --plot results/bench_rollout_ngram.png 2>&1 \
        | grep -v "$QUIET" | tee results/bench_rollout_ngram.log
}
sweep_mixed_t1() {  # the mixed stream sampled at temperature 1.0 (probabilistic verification)
    $D bench sweep --model $MODEL --speculative-config "$SPEC" --profile $PROFILE --dataset mixed $SWEEP \
        --temperature 1.0 --configs none,goodput,per-request --result-file results/sweep_mixed_t1.json \
        --plot results/sweep_mixed_t1.png 2>&1 | grep -v "$QUIET" | tee results/sweep_mixed_t1.log
}
sweep_cross() {
    $D bench sweep --model $MODEL --speculative-config "$SPEC" --profile $PROFILE --dataset mtbench $SWEEP \
        --configs none,K=1,K=3,goodput,per-request --result-file results/sweep_cross.json \
        --plot results/sweep_cross.png 2>&1 | grep -v "$QUIET" | tee results/sweep_cross.log
}
rollout_code() {  # code prompts (where the pair accepts ~0.9 even sampled) and a longer tail (sigma 1.2)
    $D bench rollout --model $MODEL --speculative-config "$SPEC" --profile $PROFILE --dataset humaneval \
        --num-prompts 64 --lengths longtail --median-tokens 32 --length-sigma 1.2 --max-tokens 1024 \
        --rounds 1 --result-file results/bench_rollout_code.json --plot results/bench_rollout_code.png 2>&1 \
        | grep -v "$QUIET" | tee results/bench_rollout_code.log
}
profile_mtbench() {  # the reverse cross-dataset direction profiles on MT-Bench (both cores)
    $D profile --model $MODEL --speculative-config "$SPEC" --dataset mtbench --batch-sizes 1,2,4,8,16 \
        --rounds 2 --num-prompts 16 --max-tokens 96 --output results/profile_qwen_pair_mtbench.json \
        --plot results/goodput_mtbench.png 2>&1 | grep -v "$QUIET" | tee results/profile_mtbench.log
}
sweep_cross_reverse() {  # profiled on MT-Bench, served HumanEval
    $D bench sweep --model $MODEL --speculative-config "$SPEC" --profile results/profile_qwen_pair_mtbench.json \
        --dataset humaneval $SWEEP --configs none,K=1,K=3,K=5,goodput,per-request \
        --result-file results/sweep_cross_reverse.json --plot results/sweep_cross_reverse.png 2>&1 \
        | grep -v "$QUIET" | tee results/sweep_cross_reverse.log
}
sweep_cross_reverse_t1() {  # profiled on MT-Bench (greedy), served HumanEval sampled at temperature 1.0
    $D bench sweep --model $MODEL --speculative-config "$SPEC" --profile results/profile_qwen_pair_mtbench.json \
        --dataset humaneval $SWEEP --temperature 1.0 --configs none,K=1,K=3,K=5,goodput,per-request \
        --result-file results/sweep_cross_reverse_t1.json --plot results/sweep_cross_reverse_t1.png 2>&1 \
        | grep -v "$QUIET" | tee results/sweep_cross_reverse_t1.log
}
sweep_cross_t1() {  # profiled on HumanEval (greedy), served MT-Bench sampled at temperature 1.0
    $D bench sweep --model $MODEL --speculative-config "$SPEC" --profile $PROFILE --dataset mtbench $SWEEP \
        --temperature 1.0 --configs none,K=1,K=3,goodput,per-request --result-file results/sweep_cross_t1.json \
        --plot results/sweep_cross_t1.png 2>&1 | grep -v "$QUIET" | tee results/sweep_cross_t1.log
}
rollout64_catchup() {  # rollout64's shape, none and fixed K=1 only: the drafter's catch-up in the step budget
    $D bench rollout --model $MODEL --speculative-config "$SPEC" --dataset mtbench --fixed-ks 1 \
        --num-prompts 64 --lengths longtail --median-tokens 48 --max-tokens 512 --rounds 1 \
        --result-file results/bench_rollout64_catchup.json --plot results/bench_rollout64_catchup.png 2>&1 \
        | grep -v "$QUIET" | tee results/bench_rollout64_catchup.log
}
cross_t1() {  # both sampled cross-dataset sweeps: $1 concurrencies, $2 prompts per concurrency, $3 rounds,
    # $4 file prefix, $5 and $6 the fixed configurations beside the policies (on HumanEval, on MT-Bench)
    CT="--concurrency $1 --prompts-per-concurrency $2 --min-prompts 8 --max-tokens 128 --rounds $3"
    CT="$CT --temperature 1.0"
    $D bench sweep --model $MODEL --speculative-config "$SPEC" --profile results/profile_qwen_pair_mtbench.json \
        --dataset humaneval $CT --configs $5,goodput,per-request --result-file results/$4_humaneval.json \
        --plot results/$4_humaneval.png 2>&1 | grep -v "$QUIET" | tee results/$4_humaneval.log
    $D bench sweep --model $MODEL --speculative-config "$SPEC" --profile $PROFILE \
        --dataset mtbench $CT --configs $6,goodput,per-request --result-file results/$4_mtbench.json \
        --plot results/$4_mtbench.png 2>&1 | grep -v "$QUIET" | tee results/$4_mtbench.log
}
sweep_c2_t1() { cross_t1 2 8 4 sweep_c2_t1 K=5 K=1; }  # 4 rounds of 4 prompts: the cells closest to the line
sweep_c2_t1_long() { cross_t1 2 20 2 sweep_c2_t1_long K=5 K=1; }  # 20 x C prompts (the reference's count)
# the other concurrencies with 20 x C prompts, beside every fixed configuration that was best or
# within 4% of the best at C = 1, 4 or 8 in the 8 x C sweeps of that direction (greedy or sampled)
sweep_c148_t1_long() { cross_t1 1,4,8 20 2 sweep_c148_t1_long none,K=3,K=5 none,K=1,K=3; }
rollout_code_window() {  # rollout_code's shape (none was its best fixed by 18%), each policy also with
    # draft_context_window 64 on the same engine: the tail's catch-up reads 68 tokens per request
    # instead of 300-700. Two rounds (about 30 minutes)
    $D bench rollout --model $MODEL --speculative-config "$SPEC" --profile $PROFILE --dataset humaneval \
        --num-prompts 64 --lengths longtail --median-tokens 32 --length-sigma 1.2 --max-tokens 1024 \
        --fixed-ks "" --draft-context-window 64 --rounds 2 --result-file results/bench_rollout_code_window.json \
        --plot results/bench_rollout_code_window.png 2>&1 | grep -v "$QUIET" | tee results/bench_rollout_code_window.log
}
sweep_mixed_ngram() {  # the mixed stream with n-gram drafting and its auto profile (rows filled)
    $D bench sweep --model $MODEL --speculative-config '{"method": "ngram", "num_speculative_tokens": 5}' \
        --profile results/profile_ngram_auto.json --dataset mixed $SWEEP \
        --configs none,goodput,per-request --result-file results/sweep_mixed_ngram.json \
        --plot results/sweep_mixed_ngram.png 2>&1 | grep -v "$QUIET" | tee results/sweep_mixed_ngram.log
}
rollout_lowest_bound() {  # the shape rollout_bound.py rated lowest by the EPYC's first pair profile
    # (3fc64bd: N=32, median 128, sigma 1.2, cap 2048; RESULTS has what later profiles rate lowest)
    # $1 speculative config, $2 profile, $3 result name (results/epyc/ holds the AMD EPYC runs)
    $D bench rollout --model $MODEL --speculative-config "$1" --profile "$2" --dataset humaneval \
        --num-prompts 32 --lengths longtail --median-tokens 128 --length-sigma 1.2 --max-tokens 2048 --rounds 2 \
        --result-file results/$3.json --plot results/$3.png 2>&1 | grep -v "$QUIET" | tee results/$3.log
}
rollout_pair_epyc() {  # PAIR_PROFILE, ROLLOUT_NAME: another profile and result name
    rollout_lowest_bound "$SPEC" "${PAIR_PROFILE:-results/epyc/profile_qwen_pair_humaneval.json}" \
        "${ROLLOUT_NAME:-epyc/bench_rollout_pair}"
}
rollout_ngram_epyc() {  # NGRAM_PROFILE, ROLLOUT_NAME: another profile and result name
    rollout_lowest_bound '{"method": "ngram", "num_speculative_tokens": 5}' \
        "${NGRAM_PROFILE:-results/epyc/profile_ngram_auto.json}" "${ROLLOUT_NAME:-epyc/bench_rollout_ngram}"
}
for step in ${STEPS:-profile sweep_mixed rollout sweep_cross}; do
    "$step"
done
