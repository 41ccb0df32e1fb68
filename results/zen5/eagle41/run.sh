#!/usr/bin/env bash
# Issue 41 on zen5: an EAGLE-3 head trained on the target's own answers (320 ShareGPT first turns,
# collected before) and on ShareGPT's own replies read by the target teacher-forced (--answers
# dataset, collected before with --collect-only), then measured at batch 1 on MT-Bench beside the
# draft model and the n-gram. Data and head stay in bench-results/heads/zen5-eagle3 (ShareGPT has no
# license); the log, card and bench JSON are copied here.
#   NUM_PROMPTS=<prompts collected> TRAIN_MIN=60 bash results/zen5/eagle41/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=results/zen5/eagle41 head=bench-results/heads/zen5-eagle3
.venv/bin/dynaspec train-draft --model qwen2.5-coder-1.5b-instruct --output "$head" --dataset sharegpt \
    --answers dataset --num-prompts "${NUM_PROMPTS:?}" --max-tokens 256 --draft-vocab-size 16384 \
    --intermediate-size 4096 --epochs "${EPOCHS:-3}" --eval-every 250 --time-budget-min "${TRAIN_MIN:-60}" \
    --holdout 0.1 > "$out/train.log" 2>&1
cp "$head/training_log.json" "$out/train_draft_log.json"
cp "$head/README.md" "$out/head_card.md"
.venv/bin/dynaspec bench spec --dataset mtbench --num-prompts 8 --max-tokens 128 --ks 1,2,3 --ngram-k 4 \
    --draft-vocab-size 0 --eagle3 "$head" --eagle-k 1,2,3 --no-hf --no-llamacpp \
    --result-file "$out/spec_mtbench.json" > "$out/spec_mtbench.log" 2>&1
