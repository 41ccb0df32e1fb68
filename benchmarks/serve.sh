#!/usr/bin/env bash
# Figure: serving with speculation: a real `dynaspec serve` with the pair on loopback, and the
# streaming client against it, 4 MT-Bench requests at concurrency 2, 32 tokens: output tok/s, TTFT,
# TPOT, acceptance length (results/README.md, "Serving"). Last measured on an AMD EPYC VM before the
# GGUF kernels (stale; the file is only in history: `git show e12b4e2:results/bench_serve.json`);
# about 3 minutes on 2 cores, the server's start included (estimate).
#   bash benchmarks/serve.sh [result-stem] [port]   (default bench-results/serve, port 8011)
# Writes <stem>.json and the server's log <stem>_server.log.
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0" && exit 0 ;; esac
cd "$(dirname "$0")/.."
stem=${1:-bench-results/serve}
port=${2:-8011}
mkdir -p "$(dirname "$stem")"
.venv/bin/dynaspec serve --model qwen2.5-coder-1.5b-instruct --speculative-config @results/spec_qwen_pair.json \
    --port "$port" >"${stem}_server.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null' EXIT
for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 "$server" 2>/dev/null || { echo "the server exited: see ${stem}_server.log" >&2 && exit 1; }
    sleep 1
done
.venv/bin/dynaspec bench serve --base-url "http://127.0.0.1:$port" --dataset mtbench --num-prompts 4 \
    --max-concurrency 2 --max-tokens 32 --result-file "$stem.json"
