#!/usr/bin/env bash
# Figure: process start to first token and peak RSS of the 1.5B target, the target with its drafter
# (int4, the default, and the file's own blocks) and llama.cpp on the same file, each in a fresh
# process, median of 3 (results/README.md, "Footprint"). Measured on xeon
# (results/xeon/bench_footprint.json, with llama.cpp) and zen4 (results/zen4/
# footprint_int4_drafter_sliced.json: the same with --no-llamacpp); about 3 minutes on 2 cores (estimate).
# llama.cpp needs scripts/setup-llamacpp.sh (the row is skipped without it).
#   bash benchmarks/footprint.sh [result-stem]   (default bench-results/footprint)
# Writes <stem>.json.
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0" && exit 0 ;; esac
cd "$(dirname "$0")/.."
stem=${1:-bench-results/footprint}
.venv/bin/dynaspec bench footprint --repeats 3 --draft-quantizations int4,auto --result-file "$stem.json"
