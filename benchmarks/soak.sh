#!/usr/bin/env bash
# Soak: the pair served by `dynaspec serve` (speculation under the goodput policy, from a profile of
# this machine), a fixed-seed mix of good and bad requests at concurrency 32 for 30 minutes, then the
# checks of issue 42: zero 5xx, greedy answers identical to alone, KV blocks and queues back to 0, RSS
# growth after warm-up < 3%, p99 drift < 10%, no traceback in the server's log (docs/serving.md, "Soak").
# `none` as the speculation runs the same load without speculation. About 35 minutes on any machine
# (the load's duration plus the server's start and the reference answers).
#   bash benchmarks/soak.sh [stem] [duration-s] [concurrency] [goodput|none] [profile]
#   (default bench-results/soak, 1800, 32, goodput, results/zen3/profile_qwen_pair_humaneval.json)
# Writes <stem>.json, <stem>.png and the server's log <stem>_server.log; exits 1 if a check fails.
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0" && exit 0 ;; esac
cd "$(dirname "$0")/.."
stem=${1:-bench-results/soak}
duration=${2:-1800}
concurrency=${3:-32}
speculation=${4:-goodput}
profile=${5:-results/zen3/profile_qwen_pair_humaneval.json}
mkdir -p "$(dirname "$stem")"
spec=()
if [ "$speculation" = goodput ]; then
    # the pair's config plus the profile the goodput policy chooses K from
    .venv/bin/python -c 'import json, sys
config = json.load(open("results/spec_qwen_pair.json"))
json.dump({**config, "dynamic_config_path": sys.argv[1]}, open(sys.argv[2], "w"))' "$profile" "${stem}_spec.json"
    spec=(--speculative-config "@${stem}_spec.json")
fi
.venv/bin/dynaspec bench soak --model qwen2.5-coder-1.5b-instruct "${spec[@]}" --duration-s "$duration" \
    --concurrency "$concurrency" --sample-every-s 10 --result-file "$stem.json" --plot "$stem.png"
