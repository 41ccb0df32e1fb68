"""What a speculative step costs in a rollout's tail, against the profile's short greedy steps: the
pair at fixed K, requests whose context is --contexts tokens long, greedy and sampled at
temperature 1.0 side by side (the figures behind `git show e12b4e2:results/RESULTS.md`, "A probe's price").
Prints the median step per (context, K, temperature), and for the sampled steps where it went: the
drafter's passes, the target's pass (with its LM head) and the rest (sampling, verification,
bookkeeping); writes JSON.

    .venv/bin/python benchmarks/probes/sampled_step.py [--batch-size 1] [--ks 0,1,3,5] [--contexts 200,2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from dynaspec import SamplingParams
from dynaspec.bench.common import format_table
from dynaspec.engine.engine import Engine, EngineConfig


def engine_for(args, k: int) -> Engine:
    spec = None
    if k:
        with open(args.spec) as f:
            spec = json.load(f) | {"num_speculative_tokens": k}
    engine = Engine(
        EngineConfig(model=args.model, speculative_config=spec, progress=False, kv_cache_memory_gb=1.0)
    )
    if k and args.bare_cut:
        engine.proposer.head_rows = None  # the cut head alone, without the context's own ids
    return engine


def step_times(engine: Engine, args, context: int, temperature: float) -> list[tuple[float, float, float]]:
    """(step ms, drafter ms, target ms) of each timed step."""
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Write a quicksort in Python."}])
    params = SamplingParams(max_tokens=10**4, temperature=temperature, ignore_eos=True, seed=0)
    for _ in range(args.batch_size):
        engine.add_request(ids + [ids[-1]] * (context - len(ids)), params)
    for _ in range(4):  # prefill, the drafter's catch-up, warm-up
        engine.step()
    out = []
    with engine.recording() as recording:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            timing = recording.timings[-1]
            drafter = sum(p.ms for p in timing.draft_passes)
            out.append(((time.perf_counter() - t0) * 1000, drafter, timing.target_ms))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--spec", default="results/spec_qwen_pair.json")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--ks", default="0,1,3,5")
    p.add_argument("--contexts", default="200,2000", help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--bare-cut", action="store_true", help="a cut drafter head scores no context ids")
    p.add_argument("--out", default="", help="JSON file")
    args = p.parse_args()
    rows, results = [], []
    for context in [int(c) for c in args.contexts.split(",")]:
        for k in [int(k) for k in args.ks.split(",")]:
            times = {t: step_times(engine_for(args, k), args, context, t) for t in (0.0, 1.0)}
            ms = {t: statistics.median(s for s, _, _ in times[t]) for t in times}
            drafter = statistics.median(d for _, d, _ in times[1.0])
            target = statistics.median(g for _, _, g in times[1.0])
            rest = statistics.median(s - d - g for s, d, g in times[1.0])
            results.append(
                {
                    "context": context,
                    "k": k,
                    "greedy_ms": ms[0.0],
                    "sampled_ms": ms[1.0],
                    "sampled_drafter_ms": drafter,
                    "sampled_target_ms": target,
                    "sampled_rest_ms": rest,
                }
            )
            rows.append(
                [context, k, f"{ms[0.0]:.1f}", f"{ms[1.0]:.1f}", f"{ms[1.0] / ms[0.0]:.2f}"]
                + [f"{drafter:.1f}", f"{target:.1f}", f"{rest:.1f}"]
            )
    print(f"batch {args.batch_size}: median step ms over {args.steps} steps (drafter, target, rest: sampled)")
    headers = ["context", "K", "greedy ms", "sampled ms", "sampled / greedy", "drafter", "target", "rest"]
    print(format_table(headers, rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
