#!/usr/bin/env bash
# run.sh's MT-Bench measurement again, the configurations that decide issue 41's line only (plain,
# the draft model at K=1 and 2, n-gram K=4, eagle3 K=1): the same 8 prompts x 128 tokens, batch 1.
#   bash results/zen5/eagle41/repeat.sh <name>     (writes results/zen5/eagle41/<name>.{json,log})
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=results/zen5/eagle41 name=${1:?name}
.venv/bin/dynaspec bench spec --dataset mtbench --num-prompts 8 --max-tokens 128 --ks 1,2 --ngram-k 4 \
    --draft-vocab-size 0 --eagle3 bench-results/heads/zen5-eagle3 --eagle-k 1 --no-hf --no-llamacpp \
    --result-file "$out/$name.json" > "$out/$name.log" 2>&1
