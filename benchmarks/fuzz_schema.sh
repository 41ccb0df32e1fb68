#!/usr/bin/env bash
# Schema fuzz: schemathesis generates requests from a real `dynaspec serve`'s /openapi.json (valid and
# invalid bodies, every operation, a fixed seed) and the run reports every 5xx and every traceback in
# the server's log (issue 42's acceptance: >= 900 cases, no 5xx; the server must still answer /health
# after the run). The server runs a tiny random model (a context of 256 tokens) or a model you name.
# A hook sets the `model` field of generated bodies to the served name and folds output budgets above
# 16 tokens into 1..16, so that valid bodies reach the engine and finish quickly.
# 1,138 cases in about 5 minutes on 2 cores with the tiny model, plus a minute to install schemathesis.
#   bash benchmarks/fuzz_schema.sh [stem] [model] [examples-per-operation] [port] [seed]
#   (default bench-results/fuzz_schema, tiny, 450, 8012, 0)
# Writes <stem>_server.log (the server's log) and <stem>_schemathesis.log (the fuzzer's).
# schemathesis is installed on first use into its own venv, bench-results/fuzz-venv, never into .venv:
# its pytest plugin would then load in every test run, and the test suite must not depend on it.
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0" && exit 0 ;; esac
cd "$(dirname "$0")/.."
stem=${1:-bench-results/fuzz_schema}
model=${2:-tiny}
examples=${3:-450}
port=${4:-8012}
seed=${5:-0}
mkdir -p "$(dirname "$stem")" bench-results
fuzz_venv=bench-results/fuzz-venv
if [ ! -x "$fuzz_venv/bin/st" ]; then
    .venv/bin/python -m venv "$fuzz_venv"
    "$fuzz_venv/bin/pip" install -q schemathesis
fi
serve_args=()
if [ "$model" = tiny ]; then
    model=$(PYTHONPATH=tests .venv/bin/python -c 'import sys; from pathlib import Path
from support.tiny import cached_tiny_model_dir
print(cached_tiny_model_dir(Path(sys.argv[1]), arch="qwen2", seed=0, num_layers=2))' bench-results/tiny)
    serve_args=(--dtype float32 --kv-cache-memory-gb 0.05 --max-model-len 256)
fi
.venv/bin/dynaspec serve --model "$model" --served-model-name fuzz --port "$port" "${serve_args[@]}" \
    >"${stem}_server.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null' EXIT
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 "$server" 2>/dev/null || { echo "the server exited: see ${stem}_server.log" >&2 && exit 1; }
    sleep 1
done
hooks=$(mktemp -d)
cat >"$hooks/fuzz_hooks.py" <<'EOF'
import schemathesis


@schemathesis.hook
def map_body(context, body):
    """Name the served model in generated bodies and fold large output budgets into 1..16 tokens, so
    that valid bodies get past the 404 and the context check to the engine (bad values stay bad)."""
    if isinstance(body, dict):
        if isinstance(body.get("model"), str):
            body["model"] = "fuzz"
        for name in ("max_tokens", "max_completion_tokens"):
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 16:
                body[name] = value % 16 + 1
    return body
EOF
status=0
PYTHONPATH="$hooks" SCHEMATHESIS_HOOKS=fuzz_hooks "$fuzz_venv/bin/st" run "http://127.0.0.1:$port/openapi.json" \
    --checks not_a_server_error --phases examples,coverage,fuzzing --max-examples "$examples" --seed "$seed" \
    --workers 2 --request-timeout 120 --no-color >"${stem}_schemathesis.log" 2>&1 || status=$?
rm -r "$hooks"
alive=no
curl -sf "http://127.0.0.1:$port/health" >/dev/null && alive=yes
kill -TERM "$server" && wait "$server" || true
trap - EXIT
requests=$(grep -c 'dynaspec.access:' "${stem}_server.log" || true)
server_errors=$(grep -cE 'dynaspec.access: .*" 5[0-9][0-9] ' "${stem}_server.log" || true)
tracebacks=$(grep -c 'Traceback' "${stem}_server.log" || true)
sed -n '/^API Operations:/,$p' "${stem}_schemathesis.log"
echo "schemathesis exit status: $status (its own errors count here too; logs: ${stem}_schemathesis.log)"
echo "requests served: $requests, 5xx: $server_errors, tracebacks in the server log: $tracebacks," \
    "server alive after the run: $alive"
[ "$server_errors" -eq 0 ] && [ "$tracebacks" -eq 0 ] && [ "$alive" = yes ]
