"""What per-request K could gain over one K for the batch, by the profile's own prices
(`git show e12b4e2:results/RESULTS.md`, "Mixed traffic"): half the requests accept as HumanEval does, half as
MT-Bench does (each profile's acceptance per position, greedy), and every assignment of K is
priced by the per-request rule's own terms (a fresh `GoodputK` on the profile: its `itl` and
`drafted_cost`), ITL(bs, 0) + what the drafts add at the load's row of the profile's smoothed grid
(read at K = drafted tokens / bs) with one drafter pass per draft position over the m_j requests
drafting it. The best uniform K (given to the
first n requests, as the batch-level rule may) against the best K per request (exhaustive over a
K per kind of request); catch-up left out (caught-up requests).
Run: .venv/bin/python benchmarks/probes/per_request_bound.py (a second)."""

import argparse
import itertools

from dynaspec.kpolicy.goodput import GoodputK
from dynaspec.kpolicy.profile import load_profile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="results/profile_qwen_pair_humaneval.json", help="the ITL grid")
    p.add_argument("--code", default="results/profile_qwen_pair_humaneval.json", help="code acceptance")
    p.add_argument("--chat", default="results/xeon/profile_qwen_pair_mtbench.json", help="chat acceptance")
    p.add_argument("--concurrency", default="2,4,8")
    args = p.parse_args()
    code = load_profile(args.code).acceptance_rate_per_pos
    chat = load_profile(args.chat).acceptance_rate_per_pos
    max_k = min(len(code), len(chat))
    rule = GoodputK(load_profile(args.profile), max_k)  # no live traffic: the profile's prices

    def goodput(ks: list[int], alphas: list[list[float]]) -> float:
        """Tokens per second of a step where request i drafts ks[i], priced per draft layer."""
        plain = rule.itl(len(ks), 0)
        if plain is None:
            raise SystemExit(f"no ITL({len(ks)}, 0) from the profile")
        layers = tuple(sum(k > j for k in ks) for j in range(max(ks, default=0)))
        ms = plain + rule.drafted_cost(len(ks), layers)
        tokens = len(ks) + sum(sum(a[:k]) for a, k in zip(alphas, ks))
        return 1000.0 * tokens / ms

    print(f"code acceptance {' '.join(f'{a:.2f}' for a in code)}; chat {' '.join(f'{a:.2f}' for a in chat)}")
    print(f"{'C':>3} {'plain':>8} {'uniform K (n)':>16} {'per request (code, chat)':>26} {'ratio':>6}")
    for c in (int(x) for x in args.concurrency.split(",")):
        alphas = [code if i % 2 == 0 else chat for i in range(c)]
        ordered = sorted(alphas, key=lambda a: -a[0])  # a uniform K for the n best-accepting
        uniform = max(
            [(goodput([0] * c, ordered), 0, 0)]
            + [
                (goodput([k] * n + [0] * (c - n), ordered), k, n)
                for k in range(1, max_k + 1)
                for n in range(1, c + 1)
            ],
            key=lambda u: (u[0], -u[1]),
        )
        per_kind = max(
            (
                (goodput([kc if i % 2 == 0 else kh for i in range(c)], alphas), kc, kh)
                for kc, kh in itertools.product(range(max_k + 1), repeat=2)
            ),
            key=lambda u: (u[0], -u[1] - u[2]),
        )
        print(
            f"{c:>3} {goodput([0] * c, alphas):>8.2f} {uniform[0]:>9.2f} K={uniform[1]} ({uniform[2]})"
            f" {per_kind[0]:>17.2f} ({per_kind[1]}, {per_kind[2]}) {per_kind[0] / uniform[0]:>6.3f}"
        )


if __name__ == "__main__":
    main()
