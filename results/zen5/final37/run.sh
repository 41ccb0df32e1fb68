#!/usr/bin/env bash
# Issue 37: the four auto-profile sweeps again at 8 rounds (the pair and the n-gram on code, then
# chat), 3 x C prompts (at least 4), after the pair's and the n-gram's cached auto profiles were
# moved out of ~/.cache/dynaspec/profiles, so the first sweep of each drafter makes a fresh one.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=bench-results/zen5/final37
. results/zen5/sweeps37.sh
ROUNDS=8 PROMPTS_PER_C=3 sweeps "pair humaneval" "ngram humaneval" "pair mtbench" "ngram mtbench"
