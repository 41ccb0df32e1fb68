"""How long the goodput policy takes to choose K for one step (it runs on the engine's hot path):
per-request and batch-level, at loads of 8 and 32, a third of the requests still owing the drafter
part of their prompt, on a profile's grid.

    .venv/bin/python benchmarks/probes/choose_time.py \
        [--profile results/zen4/profile_qwen_pair_humaneval_7.json]
"""

import argparse

from dynaspec.bench.common import ms_per_call
from dynaspec.engine.types import DraftCandidate
from dynaspec.kpolicy.goodput import GoodputK
from dynaspec.kpolicy.profile import load_profile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="results/zen4/profile_qwen_pair_humaneval_7.json")
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args()
    profile = load_profile(args.profile)
    print(f"{'rule':<12} {'load':>5} {'ms per choice':>14}")
    for per_request in (True, False):
        rule = GoodputK(profile, profile.max_num_speculative_tokens, per_request=per_request)
        for bs in (8, 32):
            candidates = [
                DraftCandidate(1 + (i % 3) * 50, 100, prompt_tokens=100, max_tokens=128, request_id=str(i))
                for i in range(bs)
            ]
            ms = ms_per_call(lambda rule=rule, candidates=candidates: rule.choose(candidates), args.repeats)
            print(f"{'per-request' if per_request else 'batch-level':<12} {bs:>5} {ms:>14.2f}")


if __name__ == "__main__":
    main()
