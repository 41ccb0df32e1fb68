#!/usr/bin/env bash
# Every figure in results/RESULTS.md, reproduced on the default offline models (CPU, default
# quantization: the GGUF files' own blocks). llama.cpp columns need scripts/setup-llamacpp.sh first.
# Run on a quiet machine: the configurations are compared side by side, but the machine must be
# otherwise idle for the absolute numbers to mean anything. About 1 hour on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
DS=.venv/bin/dynaspec
SPEC=@results/spec_qwen_pair.json
mkdir -p results
$DS bench spec --dataset humaneval --num-prompts 4 --max-tokens 128 --no-hf --result-file results/bench_spec.json 2>&1 | tee results/bench_spec.log
$DS bench decode --batch-sizes 1,8 --max-tokens 64 --repeats 3 --result-file results/bench_decode.json 2>&1 | tee results/bench_decode.log
$DS bench footprint --repeats 3 --result-file results/bench_footprint.json 2>&1 | tee results/bench_footprint.log
$DS bench perplexity --result-file results/bench_perplexity.json 2>&1 | tee results/bench_perplexity.log
$DS profile --model qwen2.5-coder-1.5b-instruct --speculative-config $SPEC --dataset humaneval \
    --batch-sizes 1,2,4,8,16,32 \
    --output results/profile_qwen_pair_humaneval.json --plot results/goodput_qwen_pair_humaneval.png 2>&1 | tee results/profile.log
$DS bench sweep --model qwen2.5-coder-1.5b-instruct --speculative-config $SPEC \
    --profile results/profile_qwen_pair_humaneval.json --dataset humaneval --concurrency 1,2,4,8,16 \
    --prompts-per-concurrency 4 --min-prompts 16 --max-tokens 32 --rounds 2 \
    --result-file results/sweep_quantized.json --plot results/sweep_quantized.png 2>&1 | tee results/sweep_quantized.log
# issue 13: per-request K on mixed traffic, the rollout tail, cross-dataset (its own script: ~1 h)
THREADS=1 STEPS="profile sweep_mixed" bash benchmarks/issue13.sh
THREADS=2 STEPS="rollout sweep_cross rollout64 rollout_ngram sweep_mixed_t1" bash benchmarks/issue13.sh
.venv/bin/python benchmarks/plot_k_choice.py results/profile_qwen_pair_humaneval.json docs/k_choice.png
# issue 14: replicas behind the router, simulated over the profile
$DS bench replicas-sim 2>&1 | tee results/replicas_sim.log
# serving: a real server with speculation, and the streaming client against it
$DS serve --model qwen2.5-coder-1.5b-instruct --speculative-config $SPEC --port 8011 > results/serve_server.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null' EXIT
for _ in $(seq 120); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 1; done
$DS bench serve --base-url http://127.0.0.1:8011 --dataset mtbench --num-prompts 16 --max-concurrency 4 \
    --max-tokens 64 --result-file results/bench_serve.json 2>&1 | tee results/bench_serve.log
