#!/usr/bin/env bash
# A/B of the goodput rule's host time, d141d9c (plain floats for the step prices) against the commit
# before it: benchmarks/probes/choose_time.py on the pair's zen5 auto profile, the two trees
# alternating for 3 rounds (each tree's code through PYTHONPATH from a git worktree), then the
# decisions of both on 6,000 random loads (benchmarks/probes/policy_decisions.py), compared.
# Writes results/zen5/le40/choose_ab/{before,after}_<round>.txt and decisions.txt.
#   bash results/zen5/le40/choose_ab.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
root=$PWD out=$PWD/results/zen5/le40/choose_ab
mkdir -p "$out"
for rev in d141d9c~1 d141d9c; do
    dir=/tmp/choose_ab_$(git rev-parse --short "$rev")
    [ -d "$dir" ] || git worktree add -q --detach "$dir" "$rev"
done
before=/tmp/choose_ab_$(git rev-parse --short d141d9c~1) after=/tmp/choose_ab_$(git rev-parse --short d141d9c)
profile=$root/results/zen5/final37/auto_profile_pair.json
profiles=$profile,$root/results/zen5/final37/auto_profile_ngram.json
cd /tmp  # so that each tree's dynaspec is the one imported
for round in 1 2 3; do
    for side in before after; do
        tree=${!side}
        PYTHONPATH=$tree "$root/.venv/bin/python" "$tree/benchmarks/probes/choose_time.py" --profile "$profile" \
            2>/dev/null > "$out/${side}_$round.txt"
    done
done
for side in before after; do
    PYTHONPATH=${!side} "$root/.venv/bin/python" "$root/benchmarks/probes/policy_decisions.py" \
        --profiles "$profiles" --out "/tmp/choose_ab_decisions_$side.json" 2>/dev/null
done
if cmp -s /tmp/choose_ab_decisions_before.json /tmp/choose_ab_decisions_after.json; then
    echo "6,000 decisions identical" > "$out/decisions.txt"
else
    echo "decisions differ" > "$out/decisions.txt"
fi
cat "$out/decisions.txt"
