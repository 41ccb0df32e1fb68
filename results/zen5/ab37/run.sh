#!/usr/bin/env bash
# Issue 37, at commit fc08373 (drift-one left with the revert that followed): the split drift
# (per-request, 4c3024c) against one drift for the grid (drift-one) side by
# side in each sweep: the pair on code and chat, then the n-gram; 4 rounds, 4 x C prompts, the auto
# profiles cached on this machine.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=bench-results/zen5/ab37
. results/zen5/sweeps37.sh
EXTRA_CONFIGS=drift-one ROUNDS=4 PROMPTS_PER_C=4 sweeps "pair humaneval" "pair mtbench" "ngram mtbench" \
    "ngram humaneval"
