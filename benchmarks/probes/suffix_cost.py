"""Suffix decoding's host cost and memory at a large cache (issue 40: <= 0.1 ms a request a step at
K=5 with a 1M-token cache; the cache within its budget under 10,000 requests). No model: token
sequences from a small vocabulary with repeated phrases, as code and rollouts repeat themselves.

    .venv/bin/python benchmarks/probes/suffix_cost.py                        # ~1M cached tokens
    .venv/bin/python benchmarks/probes/suffix_cost.py --requests 10000 --output-tokens 150

It prints the cache it filled, then one JSON line of the figures (also written to ``--json PATH``).
"""

import argparse
import json
import random
import resource
import time
from pathlib import Path

from dynaspec.spec_decode.suffix_tree import SuffixIndex


def sequence(rng: random.Random, phrases: list[list[int]], length: int) -> list[int]:
    out: list[int] = []
    while len(out) < length:
        out += rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(32000)]
    return out[:length]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="finished requests put through the cache")
    ap.add_argument("--prompts", type=int, default=250, help="distinct prompts (the rest repeat them)")
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--output-tokens", type=int, default=500)
    ap.add_argument("--budget", type=int, default=1 << 20, help="the cache's token budget")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--live", type=int, default=32, help="live requests drafted for, token by token")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", type=Path, help="also write the results' JSON line here")
    args = ap.parse_args()
    rng = random.Random(0)
    phrases = [[rng.randrange(32000) for _ in range(rng.randint(3, 12))] for _ in range(400)]
    prompts = [sequence(rng, phrases, args.prompt_tokens) for _ in range(args.prompts)]
    index = SuffixIndex(max_depth=24, max_cached_requests=args.requests, max_cached_tokens=args.budget)
    start = time.perf_counter()
    for i in range(args.requests):
        index.add(("done", i), prompts[i % len(prompts)], sequence(rng, phrases, args.output_tokens))
        index.finish(("done", i))
    fill_s = time.perf_counter() - start
    filled = index.stats()
    print(f"cache: {filled} filled in {fill_s:.1f} s")
    live = [("live", j) for j in range(args.live)]
    texts = [sequence(rng, phrases, args.steps + 1) for _ in live]
    for key, j in zip(live, range(args.live)):
        index.add(key, prompts[j % len(prompts)], texts[j][:1])
    updating, drafting, calls, drafted = 0.0, 0.0, 0, 0
    for step in range(1, args.steps):
        for key, text in zip(live, texts):
            t0 = time.perf_counter()
            index.extend(key, text[step : step + 1])
            t1 = time.perf_counter()
            spec = index.speculate(key, args.k, 1.0, 0.1)
            t2 = time.perf_counter()
            updating += t1 - t0
            drafting += t2 - t1
            calls += 1
            drafted += len(spec.tokens)
    after = index.stats()
    result = {
        "requests": args.requests,
        "output_tokens": args.output_tokens,
        "k": args.k,
        "calls": calls,
        "ms_update": round(1e3 * updating / calls, 4),
        "ms_speculate": round(1e3 * drafting / calls, 4),
        "ms_total": round(1e3 * (updating + drafting) / calls, 4),
        "drafted_per_call": round(drafted / calls, 3),
        "cached_tokens": after["cached_tokens"],
        "budget": args.budget,
        "fill_s": round(fill_s, 1),
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "stats_filled": filled,
        "stats_after": after,
    }
    line = json.dumps(result)
    print(line)
    if args.json:
        args.json.write_text(line + "\n")


if __name__ == "__main__":
    main()
