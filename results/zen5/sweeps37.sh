# Sourced by issue 37's record scripts (results/zen5/split37, ab37, rerun37, final37, pc37).
# sweeps "<drafter> <dataset>"...: benchmarks/auto_sweep.sh for each (its environment, e.g. ROUNDS,
# from the caller), into $out/sweep_<drafter>_<dataset>.json, .png and .log.
# cell: one sweep cell at one concurrency, per-request beside none and the given fixed Ks, 8 x C
# prompts, 8 rounds, 128 tokens, greedy, on the auto profile cached on this machine (further
# arguments go to the sweep); writes $out/<name>.json and .log.
pair='{"method":"draft_model","model":"qwen2.5-coder-0.5b-instruct","num_speculative_tokens":5}'
ngram='{"method":"ngram","num_speculative_tokens":5}'
cell() { # name spec dataset concurrency fixed-ks [sweep arguments...]
    mkdir -p "$out"
    .venv/bin/dynaspec bench sweep --model qwen2.5-coder-1.5b-instruct --speculative-config "$2" \
        --profile auto --dataset "$3" --concurrency "$4" --prompts-per-concurrency 8 \
        --min-prompts $((8 * $4)) --fixed-ks "$5" --configs "none,$(echo "$5" | sed 's/\([0-9]\)/K=\1/g'),per-request" \
        --max-tokens 128 --rounds 8 "${@:6}" --result-file "$out/$1.json" > "$out/$1.log" 2>&1
}

sweeps() {
    mkdir -p "$out"
    for run in "$@"; do
        set -- $run
        bash benchmarks/auto_sweep.sh "$1" "$2" "$out/sweep_$1_$2" > "$out/sweep_$1_$2.log" 2>&1
    done
}
