"""What a free draft token (a suffix match beside a draft model: no drafter pass) costs by a
profile, per batch size: the ms it adds to a step (``GoodputK.drafted_cost`` with no drafter layer),
the acceptance above which one pays (a token worth alpha tokens pays when alpha > its ms x bs /
ITL(bs, 0)), and what the goodput policy chooses for a load whose every request offers a match of
the given frequencies (``enable_suffix_decoding``: which rows take theirs, and their drafts).

    .venv/bin/python benchmarks/probes/free_draft_price.py <profile.json> [--match 1,1,1,1,1]
"""

from __future__ import annotations

import argparse

from dynaspec.bench.common import format_table
from dynaspec.engine.types import DraftCandidate
from dynaspec.kpolicy.goodput import GoodputK
from dynaspec.kpolicy.profile import load_profile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile", help="a profile JSON (dynaspec profile, or an auto profile from the cache)")
    p.add_argument("--match", default="1,1,1,1,1", help="each offered match's token frequencies")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    p.add_argument("--context", type=int, default=300, help="each request's context tokens")
    args = p.parse_args()
    profile = load_profile(args.profile)
    match = tuple(float(x) for x in args.match.split(","))
    rows = []
    for bs in (int(x) for x in args.batch_sizes.split(",")):
        rule = GoodputK(profile, profile.max_num_speculative_tokens, hysteresis_steps=1)
        plain = rule.itl(bs, 0)
        one = rule.drafted_cost(bs, (), 1)
        load = [
            DraftCandidate(1, 1 << 20, request_id=f"r{i}", context_tokens=args.context, free_rates=match)
            for i in range(bs)
        ]
        _, drafts = rule.choose(load)
        free = rule.free_rows()
        rows.append(
            [
                bs,
                plain,
                one,
                one * bs / plain,
                rule.k_for_batch(bs),
                sum(free),
                " ".join(str(d) for d in sorted(set(drafts))),
            ]
        )
    columns = ["requests", "ITL(bs, 0) ms", "a free token ms", "break-even acceptance"]
    columns += ["drafter's K", "rows taking their match", "drafts per row"]
    print(format_table(columns, rows))


if __name__ == "__main__":
    main()
