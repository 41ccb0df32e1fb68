#!/usr/bin/env bash
# The control for run.sh: a head trained on the target's own answers alone (the 288 training
# conversations of run.sh's 320; the same 32 held out), 2 epochs, to compare held-out acceptance
# at equal training positions with run.sh's head, which also read 2,958 of ShareGPT's own replies.
#   bash results/zen5/eagle41/control.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=results/zen5/eagle41 own=bench-results/heads/zen5-own
mkdir -p "$own/data"
for f in bench-results/heads/zen5-eagle3/data/0*.pt; do ln -sf "$(realpath "$f")" "$own/data/"; done
.venv/bin/dynaspec train-draft --model qwen2.5-coder-1.5b-instruct --output "$own" --dataset sharegpt \
    --num-prompts 320 --max-tokens 256 --draft-vocab-size 16384 --intermediate-size 4096 --epochs 2 \
    --eval-every 125 --time-budget-min "${TRAIN_MIN:-8}" --holdout 0.1 --fresh > "$out/control.log" 2>&1
cp "$own/training_log.json" "$out/train_draft_log_own_only.json"
