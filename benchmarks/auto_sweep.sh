#!/usr/bin/env bash
# Figure: issue 37's check of the auto profile: a closed-loop concurrency sweep priced by the profile
# the engine makes for `"dynamic_config_path": "auto"` (made on first use and cached, or read back),
# output tok/s of none, fixed K = 1..5 and the default policy (per-request goodput) at C = 1, 2, 4, 8
# (results/README.md, "Goodput and auto profiles": the auto-profile sweeps), greedy, 128 tokens,
# 2 x C prompts (at least 4), 2 rounds:
#   drafter: pair (the 0.5B draft model, num_speculative_tokens 5) or ngram (prompt lookup, K up to 5)
#   dataset: humaneval, mtbench, or longedit (issue 40's long contexts: each prompt >= 2,000 tokens, an
#            edit after a module of code; ctx-blind, per-request without the profile's context axis,
#            runs beside per-request; the prompts are prefilled before the clock and kept in the
#            prefix cache, --warm-prompts, so the runs time decoding)
# Measured on xeon (results/xeon/auto37/: 10-13 minutes a dataset, plus about 4 to profile on first
# use); the zen3 sweeps of the record ran the same with the profile's file (about 40 minutes a dataset).
#   bash benchmarks/auto_sweep.sh pair|ngram humaneval|mtbench|longedit [result-stem]
#        (default stem bench-results/auto_sweep_<drafter>_<dataset>)
# Environment: EXTRA_CONFIGS=cells-off,stops-off adds configurations (cells-off: per-request without
# live grid cells; stops-off: per-request without confidence stops; matches-off: per-request
# pricing an n-gram's rows by acceptance, not their matches; hold-on: per-request whose hysteresis
# holds its K at any gap); ROUNDS (default 2) and PROMPTS_PER_C (default 2; at least 4 prompts a concurrency) size it;
# WARM_POLICIES=1 keeps one K policy per configuration for the whole sweep (`--warm-policies`).
# Writes <stem>.json and <stem>.png; the profile's cached file is named in the JSON ("profile").
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0" && exit 0 ;; esac
cd "$(dirname "$0")/.."
drafter=${1:?pair or ngram (--help)}
dataset=${2:?humaneval or mtbench (--help)}
case "$drafter" in
pair) spec='{"method":"draft_model","model":"qwen2.5-coder-0.5b-instruct","num_speculative_tokens":5}' ;;
ngram) spec='{"method":"ngram","num_speculative_tokens":5}' ;;
*) echo "drafter: pair or ngram, not $drafter" >&2 && exit 2 ;;
esac
configs=none,K=1,K=2,K=3,K=4,K=5,per-request${EXTRA_CONFIGS:+,$EXTRA_CONFIGS}
extra=()
case "$dataset" in
humaneval | mtbench) ;;
longedit)
    configs=$configs,ctx-blind
    # each prompt's prefill (over 10 s on the xeon) would swamp the decoding the sweep compares: every
    # prompt is prefilled before the clock, kept in the prefix cache, and the runs time decoding (a
    # draft model still reads its window's worth of each prompt when it first drafts for it)
    extra=(--warm-prompts --kv-cache-memory-gb 4)
    ;;
*) echo "dataset: humaneval, mtbench or longedit, not $dataset" >&2 && exit 2 ;;
esac
stem=${3:-bench-results/auto_sweep_${drafter}_$dataset}
.venv/bin/dynaspec bench sweep --model qwen2.5-coder-1.5b-instruct --speculative-config "$spec" --profile auto \
    --dataset "$dataset" --concurrency 1,2,4,8 --prompts-per-concurrency "${PROMPTS_PER_C:-2}" --min-prompts 4 \
    --fixed-ks 1,2,3,4,5 --configs "$configs" --max-tokens 128 --rounds "${ROUNDS:-2}" \
    ${WARM_POLICIES:+--warm-policies} ${extra[@]+"${extra[@]}"} \
    --result-file "$stem.json" --plot "$stem.png"
