#!/usr/bin/env bash
# Issue 37's chat sweep for the pair after the hysteresis change (a K held only against a near tie):
# benchmarks/auto_sweep.sh pair mtbench, fresh policies per run as issue 37's sweeps ran, 4 rounds of
# 4 x C prompts, on the pair's auto profile cached on this machine.
# Writes results/zen5/le40/sweep_pair_mtbench.{json,png,log}.
#   bash results/zen5/le40/chat.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=results/zen5/le40
ROUNDS=4 PROMPTS_PER_C=4 bash benchmarks/auto_sweep.sh pair mtbench "$out/sweep_pair_mtbench" > "$out/sweep_pair_mtbench.log" 2>&1
