"""The best rollout makespan any K policy could reach against the best fixed configuration, by the profile's
own model, over rollout shapes (`git show e12b4e2:results/RESULTS.md`, "A code rollout with a longer
tail").

For each shape (N prompts, log-normal lengths: median, sigma, cap; seed 0, as `bench rollout
--lengths longtail` draws them), `bench rollout`'s decode model (`modelled_makespans`: the
profile's ITL, the given acceptance) gives the decode of none, fixed K in {1, 3, 5} and the best K
at every batch size; the prefill, which K cannot change, is added as N x the seconds a prompt
takes (0.81 s: the 52 s the 64 HumanEval prompts took in the code rollout). The bound is
(prefill + best K per batch size) / (prefill + best fixed).

Run: .venv/bin/python benchmarks/probes/rollout_bound.py (seconds)."""

import argparse
import itertools

from dynaspec.bench.rollout import lengths_for, modelled_makespans
from dynaspec.kpolicy.profile import load_profile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="results/profile_qwen_pair_humaneval.json")
    p.add_argument(
        "--acceptance",
        default="0.84,0.71,0.62,0.55,0.50",
        help="per position (default: the code rollout's at K=5, sampled at temperature 1.0)",
    )
    p.add_argument("--prefill-s", type=float, default=0.81, help="seconds of prefill per prompt")
    p.add_argument("--top", type=int, default=8)
    p.add_argument(
        "--wide", action="store_true", help="N up to 128, medians up to 256, sigma from 0.3 (96 shapes)"
    )
    args = p.parse_args()
    profile = load_profile(args.profile)
    alpha = [float(a) for a in args.acceptance.split(",")]
    rows = []
    grid = (
        ((32, 64, 96, 128), (64, 128, 256), (0.3, 0.5, 0.8, 1.2), (1024, 2048))
        if args.wide
        else ((8, 16, 32, 64), (32, 64, 128), (0.8, 1.2, 1.5, 2.0), (1024, 2048))
    )
    for n, median, sigma, cap in itertools.product(*grid):
        shape = argparse.Namespace(
            lengths="longtail", median_tokens=median, length_sigma=sigma, max_tokens=cap, rollout_seed=0
        )
        decode = modelled_makespans(lengths_for(shape, n), profile, alpha, [1, 3, 5])
        fixed_name, fixed = min(((c, decode[c]) for c in ("none", "K=1", "K=3", "K=5")), key=lambda cv: cv[1])
        prefill = n * args.prefill_s
        best = decode["best K per batch size"]
        rows.append(((prefill + best) / (prefill + fixed), best / fixed, n, median, sigma, cap, fixed_name))
    rows.sort()
    print(
        f"{len(rows)} shapes; acceptance {' '.join(f'{a:.2f}' for a in alpha)}; the {args.top} lowest bounds:"
    )
    print(f"{'bound':>6} {'decode':>7} {'N':>3} {'median':>6} {'sigma':>5} {'cap':>5}  best fixed")
    for bound, decode_only, n, median, sigma, cap, fixed_name in rows[: args.top]:
        print(f"{bound:>6.3f} {decode_only:>7.3f} {n:>3} {median:>6} {sigma:>5} {cap:>5}  {fixed_name}")


if __name__ == "__main__":
    main()
