#!/usr/bin/env bash
# Issue 40's long-context sweep for the pair as a server runs it: one K policy per configuration kept
# for the whole sweep (WARM_POLICIES=1, `bench sweep --warm-policies`), so what per-request learnt at
# one request (edits accept 0.95) prices its choice at four; 4 rounds of 4 x C prompts, the long
# prompts prefilled before the clock (benchmarks/auto_sweep.sh longedit), on the pair's auto profile
# cached on this machine. Writes results/zen5/le40/<name>.{json,png,log}.
#   bash results/zen5/le40/run.sh [name]     (default sweep_pair_longedit_warm)
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=results/zen5/le40 name=${1:-sweep_pair_longedit_warm}
WARM_POLICIES=1 ROUNDS=4 PROMPTS_PER_C=4 bash benchmarks/auto_sweep.sh pair longedit "$out/$name" > "$out/$name.log" 2>&1
