#!/usr/bin/env bash
# Issue 37: the sweeps after the grid's drift was split into plain steps with the drafter's passes,
# and what verified drafts add (at commit 4c3024c, reverted since): the pair and the n-gram on chat,
# then code; the n-gram code sweep was disturbed by tests run beside it; 4 rounds, 4 x C
# prompts, the auto profiles cached on this machine.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=bench-results/zen5/split37
. results/zen5/sweeps37.sh
ROUNDS=4 PROMPTS_PER_C=4 sweeps "pair mtbench" "ngram mtbench" "pair humaneval" "ngram humaneval"
