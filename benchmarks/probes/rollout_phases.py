"""Where a rollout's makespan goes, by phase: from a `bench rollout` JSON's per-step series, each
configuration's seconds, output tokens/s and K mix while 1, 2, 3-4, 5-8, 9-16 and 17+ requests were
running, per round (`git show e12b4e2:results/RESULTS.md`, "The decoder stack as one call"). Reads
the JSON plain or gzipped (the record keeps rollout JSONs as .json.gz).

    .venv/bin/python benchmarks/probes/rollout_phases.py results/zen4/bench_rollout_pair_13.json.gz \
        [--configs none,per-request]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import itertools
import json

from dynaspec.bench.common import format_table

PHASES = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 1 << 30))


def phase_of(running: int) -> tuple[int, int] | None:
    return next((p for p in PHASES if p[0] <= running <= p[1]), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", help="a `bench rollout` JSON (.json or .json.gz)")
    p.add_argument("--configs", default="", help="comma-separated (default: every configuration)")
    args = p.parse_args()
    opener = gzip.open if args.result.endswith(".gz") else open
    with opener(args.result, "rt") as f:
        data = json.load(f)
    wanted = set(filter(None, args.configs.split(",")))
    headers = ["config", "round"] + [
        f"{lo}" if lo == hi else f"{lo}-{hi}" if hi < 1 << 30 else f"{lo}+" for lo, hi in PHASES
    ]
    rows, mixes = [], []
    for row in data["rows"]:
        if wanted and row["config"] not in wanted:
            continue
        for rnd, record in enumerate(row["rounds"], 1):
            seconds = collections.Counter()
            tokens = collections.Counter()
            ks = collections.defaultdict(collections.Counter)
            series = record["series"]  # [t_s, running, K, output tokens so far] per step
            for (t0, _, _, n0), (t1, running, k, n1) in itertools.pairwise(series):
                phase = phase_of(running)
                if phase is None:
                    continue
                seconds[phase] += t1 - t0
                tokens[phase] += n1 - n0
                ks[phase][k] += 1
            cells = [
                f"{seconds[ph]:.1f} s, {tokens[ph] / seconds[ph]:.0f}/s" if seconds[ph] else "-"
                for ph in PHASES
            ]
            rows.append([row["config"], rnd, *cells])
            mix = [" ".join(f"K{k}:{n}" for k, n in sorted(ks[ph].items())) or "-" for ph in PHASES]
            mixes.append([row["config"], rnd, *mix])
    print("seconds and output tokens/s by running requests (the first prefill step left out):")
    print(format_table(headers, rows))
    print("\nsteps by K chosen:")
    print(format_table(headers, mixes))


if __name__ == "__main__":
    main()
