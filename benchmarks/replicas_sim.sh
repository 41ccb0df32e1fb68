#!/usr/bin/env bash
# Figure: replicas behind the router, simulated over the xeon pair profile: mean latency (bursty
# traffic) and makespan (rollout) relative to no speculation at 8/16/32/64 replicas, for dynamic K per
# replica, a shared K and the best fixed K (results/README.md, "Replicas behind the router,
# simulated"). No model runs: a few minutes on any CPU. Recorded as results/xeon/replicas_sim.json,
# plot docs/replicas_sim.png.
#   bash benchmarks/replicas_sim.sh [result-stem] [profile]
#        (default stem bench-results/replicas_sim, profile results/profile_qwen_pair_humaneval.json)
# Writes <stem>.json and <stem>.png.
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0" && exit 0 ;; esac
cd "$(dirname "$0")/.."
stem=${1:-bench-results/replicas_sim}
.venv/bin/dynaspec bench replicas-sim --profile "${2:-results/profile_qwen_pair_humaneval.json}" \
    --result-file "$stem.json" --plot "$stem.png"
