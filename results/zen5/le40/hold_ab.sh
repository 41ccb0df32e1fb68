#!/usr/bin/env bash
# A/B of the goodput rule's near-tie hold (HOLD_WITHIN) on issue 37's chat cells: the pair on
# MT-Bench at C = 1, 2, 4, per-request (the hold only against a near tie) beside hold-on (the
# hysteresis holds its K at any gap, as before b995b95), none and K=1, in one process each; 8 rounds
# of 8 x C prompts (`cell` of results/zen5/sweeps37.sh). Writes results/zen5/le40/hold_mt_c<C>.{json,log}.
#   bash results/zen5/le40/hold_ab.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=results/zen5/le40
source results/zen5/sweeps37.sh
for c in 1 2 4; do
    cell "hold_mt_c$c" "$pair" mtbench "$c" 1 --configs none,K=1,per-request,hold-on
done
