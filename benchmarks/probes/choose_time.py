"""How long the goodput policy takes to choose K for one step (it runs on the engine's hot path):
per-request and batch-level, at loads of 8 and 32, a third of the requests still owing the drafter
part of their prompt, on a profile's grid; then per step on a steady load (every request caught
up, the same requests step after step) at 1, 4, 16 and 64 requests, deciding every step and
keeping a choice for ``REDECIDE_EVERY`` steps (the default where a choice costs at least
``KEEP_ABOVE_SHARE`` of a step, as on a GPU; the probe observes no step, so it keeps).

    .venv/bin/python benchmarks/probes/choose_time.py \
        [--profile results/zen4/profile_qwen_pair_humaneval_7.json
         | --gpu-bench results/h200/h200_sweep_2rounds.json]
"""

import argparse
import json
from pathlib import Path

from dynaspec.bench.common import ms_per_call
from dynaspec.engine.types import DraftCandidate
from dynaspec.kpolicy.goodput import REDECIDE_EVERY, GoodputK
from dynaspec.kpolicy.profile import Profile, derive_table, load_profile

CODE_PAIR_RATES = [0.90, 0.86, 0.81, 0.76, 0.75]  # benchmarks/gpu_bench.py's code-pair rates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="results/zen4/profile_qwen_pair_humaneval_7.json")
    p.add_argument("--gpu-bench", help="a gpu_bench.py JSON: its 7B/0.5B ITL grid, code-pair rates")
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args()
    if args.gpu_bench:
        itl = json.loads(Path(args.gpu_bench).read_text())["stages"]["pair_qwen2.5-7b"]["itl_ms"]
        grid = {int(b): {int(k): ms for k, ms in row.items()} for b, row in itl.items()}
        table = derive_table(CODE_PAIR_RATES, grid, 5, 256)
        profile = Profile(5, CODE_PAIR_RATES, grid, num_speculative_tokens_per_batch_size=table)
    else:
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
    print(f"\n{'rule':<12} {'load':>5} {'ms a step, deciding every step':>31} {f'every {REDECIDE_EVERY}':>9}")
    for per_request in (True, False):
        for bs in (1, 4, 16, 64):
            candidates = [
                DraftCandidate(1, 1000, prompt_tokens=100, max_tokens=1024, request_id=str(i))
                for i in range(bs)
            ]
            row = []
            for every in (1, REDECIDE_EVERY):
                rule = GoodputK(
                    profile, profile.max_num_speculative_tokens, per_request=per_request, redecide_every=every
                )
                row.append(
                    ms_per_call(
                        lambda rule=rule, candidates=candidates: rule.choose(candidates), args.repeats
                    )
                )
            rule_name = "per-request" if per_request else "batch-level"
            print(f"{rule_name:<12} {bs:>5} {row[0]:>31.3f} {row[1]:>9.3f}")


if __name__ == "__main__":
    main()
