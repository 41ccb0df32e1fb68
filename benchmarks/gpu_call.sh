#!/usr/bin/env bash
# The GPU machine's side of one device call (issue 38; results/README.md, "GPU: one NVIDIA H200"):
# installs the wheels carried in .whl/ (what the machine lacks: pydantic, fastapi, gguf, ...),
# unpacks the packs' tokenizer files carried in .gpu/tokenizer, then runs the CUDA tests, the GPU
# benchmark and the fused-ops benchmark, each under its own time limit, all output into $OUT.
#   bash benchmarks/gpu_call.sh TEST_S BENCH_S FUSED_S [gpu_bench.py arguments...]
# TEST_K (environment) narrows the tests (pytest -k); a limit of 0 skips that part. The sweep
# recorded on 2026-11-26 ran: TEST_K="bf16 or attention or skinny or top1" bash benchmarks/gpu_call.sh
#   70 215 0 --stages env,equality,pair7 --equality-drafters qwen2.5-0.5b --itl-batch-sizes 1,4,16,64
#   --concurrencies 1,64 --sweep-tokens 128 --sweep-rounds 2 --stage-s equality=45,pair7=100
# The next call (the projection dispatch against cuBLAS, ABBA, batch invariance with row-wise norms,
# bf16 equality on the real shapes):
#   TEST_K="skinny or dispatch or bf16 or top1 or replays" bash benchmarks/gpu_call.sh 100 330 100
#   --stages env,invariant,equality --invariant-variants off,dispatch,dispatch,off,on
#   --equality-drafters qwen2.5-0.5b --stage-s invariant=190,equality=130
set -uo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -uo/s/^# \{0,1\}//p' "$0" && exit 0 ;; esac
cd "$(dirname "$0")/.."
test_s=$1 bench_s=$2 fused_s=$3
shift 3
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/tok && cp .gpu/tokenizer/* /tmp/tok/ && gunzip -f /tmp/tok/tokenizer.json.gz
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/nvidia_smi.txt" 2>&1
if [ "$test_s" -gt 0 ]; then
    timeout "$test_s" python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_cuda_graphs.py \
        tests/models/test_fused_ops.py ${TEST_K:+-k "$TEST_K"} >"$OUT/cuda_tests.log" 2>&1
    echo "pytest exit $?" >>"$OUT/cuda_tests.log"
    tail -3 "$OUT/cuda_tests.log"
fi
if [ "$bench_s" -gt 0 ]; then
    timeout "$bench_s" python3 benchmarks/gpu_bench.py --tokenizer /tmp/tok --out "$OUT/gpu_bench.json" "$@" \
        >"$OUT/gpu_bench.log" 2>&1
    echo "gpu_bench exit $?" >>"$OUT/gpu_bench.log"
    tail -30 "$OUT/gpu_bench.log"
fi
if [ "$fused_s" -gt 0 ]; then
    timeout "$fused_s" python3 benchmarks/fused_ops_bench.py --out "$OUT/fused_ops.json" --batches 1 \
        --query-lens 1 6 --skinny-configs 16,128,4,3 32,256,4,3 >"$OUT/fused_ops.log" 2>&1
    echo "fused_ops_bench exit $?" >>"$OUT/fused_ops.log"
fi
