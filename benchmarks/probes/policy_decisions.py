"""The goodput rule's decisions on many random loads, written to a JSON file, so that two trees'
decisions can be compared (a change meant to make the policy faster must leave them identical):
per-request and batch-level on each given profile, 1,500 steps each of random loads (1-32
requests, some owing their drafter part of a prompt, some prefilling), each step observed with
random acceptance.

    PYTHONPATH=<tree> .venv/bin/python benchmarks/probes/policy_decisions.py --out a.json \
        [--profiles results/zen5/final37/auto_profile_pair.json,results/zen5/final37/auto_profile_ngram.json]
    cmp a.json b.json
"""

import argparse
import json
import random

from dynaspec.engine.types import DraftCandidate, SchedulePlan, StepRecord, StepResult, StepTiming
from dynaspec.kpolicy.goodput import GoodputK
from dynaspec.kpolicy.profile import load_profile

PROFILES = "results/zen5/final37/auto_profile_pair.json,results/zen5/final37/auto_profile_ngram.json"


def record(drafts: list[int], accepted: list[int]) -> StepRecord:
    """A step's record with what the acceptance estimates read (its timing untimed: 0 ms)."""
    result = StepResult(token_ids=[[0] * (a + 1) for a in accepted], draft_lens=list(drafts))
    plan = SchedulePlan(decodes=[], k_caps=list(drafts), prefills=[])
    timing = StepTiming(verify_tokens=len(drafts) + sum(drafts), prefill_tokens=0, target_ms=0.0)
    return StepRecord(plan, result, timing)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profiles", default=PROFILES, help="comma-separated profile files")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = []
    for path in args.profiles.split(","):
        profile = load_profile(path)
        for per_request in (True, False):
            rng = random.Random(1)
            rule = GoodputK(profile, profile.max_num_speculative_tokens, per_request=per_request)
            for _ in range(args.steps):
                load = [
                    DraftCandidate(
                        rng.choice([1, 1, 1, 3, 40, 260]),
                        rng.randint(2, 300),
                        prompt_tokens=rng.randint(50, 3000),
                        max_tokens=128,
                        request_id=str(rng.randint(0, 40)),
                        context_tokens=rng.randint(100, 4000),
                        decoding=rng.random() > 0.1,
                    )
                    for _ in range(rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 24, 32]))
                ]
                k, drafts = rule.choose(load)
                out.append([k, drafts])
                rule.observe(record(drafts, [rng.randint(0, d) for d in drafts]))
    with open(args.out, "w") as f:
        json.dump(out, f)
    print(f"{len(out)} decisions written to {args.out}")


if __name__ == "__main__":
    main()
