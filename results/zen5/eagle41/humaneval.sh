#!/usr/bin/env bash
# Issue 41's HumanEval line with run.sh's head: batch 1, 8 prompts x 128 tokens, the draft model at
# K=1 and 3, n-gram K=4, eagle3 K=1 and 3, and both drafters with suffix drafts beside them under the
# goodput policy (auto profiles made at one request). Writes results/zen5/eagle41/spec_humaneval.{json,log}.
#   bash results/zen5/eagle41/humaneval.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=results/zen5/eagle41
.venv/bin/dynaspec bench spec --dataset humaneval --num-prompts 8 --max-tokens 128 --ks 1,3 --ngram-k 4 \
    --draft-vocab-size 0 --eagle3 bench-results/heads/zen5-eagle3 --eagle-k 1,3 --with-suffix --no-hf \
    --no-llamacpp --result-file "$out/spec_humaneval.json" > "$out/spec_humaneval.log" 2>&1
