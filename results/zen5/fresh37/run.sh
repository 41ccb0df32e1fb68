#!/usr/bin/env bash
# Issue 37's second line: two fresh auto profiles of the pair (the cached file set aside before, and
# each new one moved out after its runs), each followed by the runs whose K it decides: one HumanEval
# request (which makes the profile), one MT-Bench request, and two at once; each run's log ends with
# its steps at each K by batch size. The profile set aside is put back at the end.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=bench-results/zen5/fresh37
cache=~/.cache/dynaspec/profiles
mkdir -p "$out" "$out/set_aside"
spec='{"method":"draft_model","model":"qwen2.5-coder-0.5b-instruct","num_speculative_tokens":5,"dynamic_config_path":"auto"}'
run() {  # log-name, then generate's prompt options
    local log=$1
    shift
    /usr/bin/time -f "wall %e s" .venv/bin/dynaspec generate --model qwen2.5-coder-1.5b-instruct --chat \
        --max-tokens 128 --speculative-config "$spec" "$@" > "$out/$log.log" 2>&1
}
before=$(ls "$cache" | sort)
for f in $before; do mv "$cache/$f" "$out/set_aside/"; done
for i in 1 2; do
    run "humaneval1_$i" --prompts-file humaneval --num-prompts 1
    run "mtbench1_$i" --prompts-file mtbench --num-prompts 1
    run "mtbench2_$i" --prompts-file mtbench --num-prompts 2
    for f in $(ls "$cache"); do mv "$cache/$f" "$out/auto_profile_pair_$i.json"; done
done
for f in $before; do mv "$out/set_aside/$f" "$cache/"; done
