"""Every cell of a profile's ITL(bs, K) grid against the rows its step verifies, bs x (K+1) (`git show
e12b4e2:results/RESULTS.md`, "The n-gram grid"). With n-gram drafting (no drafter passes) a cell is the
target's step alone, and cells of different (bs, K) with the same rows cost the same: the step's cost is a
function of rows, a staircase where the quantized kernels take 16 rows at a time.

    .venv/bin/python benchmarks/probes/itl_by_rows.py --profile results/profile_ngram_auto.json \
        --plot bench-results/ngram_itl_by_rows.png                                       # (a second)
"""

import argparse
from collections import defaultdict

from dynaspec.kpolicy.profile import load_profile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="results/profile_ngram_auto.json")
    p.add_argument("--plot", default=None, help="PNG of ITL against verified rows, one colour per K")
    args = p.parse_args()
    profile = load_profile(args.profile)
    by_rows: dict[int, list[tuple[int, int, float]]] = defaultdict(list)
    for bs, row in profile.batch_stats.items():
        for k, ms in row.items():
            if ms > 0:
                by_rows[bs * (k + 1)].append((bs, k, ms))
    print(f"{'rows':>5} {'ms per cell (bs x K+1)':<60} {'ms per row':>10}")
    for rows in sorted(by_rows):
        cells = sorted(by_rows[rows])
        text = "  ".join(f"{ms:.0f} ({bs}x{k + 1})" for bs, k, ms in cells)
        mean = sum(ms for _, _, ms in cells) / len(cells)
        print(f"{rows:>5} {text:<60} {mean / rows:>10.2f}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5))
        for k in range(profile.max_num_speculative_tokens + 1):
            points = sorted(
                (bs * (k + 1), row[k]) for bs, row in profile.batch_stats.items() if row.get(k, 0) > 0
            )
            ax.plot([r for r, _ in points], [ms for _, ms in points], "o-", label=f"K={k}", alpha=0.8)
        top = max(by_rows)
        for edge in range(16, top + 1, 16):
            ax.axvline(edge, color="grey", lw=0.5, ls=":")
        ax.set_xlabel("rows verified in the step, bs x (K+1) (dotted: multiples of 16)")
        ax.set_ylabel("ITL ms (median step)")
        ax.set_title(f"{args.profile}: step time against rows")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
