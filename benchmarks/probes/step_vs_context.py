"""A decode step's time against the context its requests read (`git show e12b4e2:results/RESULTS.md`, "The
n-gram grid"): bs requests of synthetic prompts of each length, prefilled, then steps at each K timed with
every row drafting its whole K (the profiler's filled n-gram rows), K interleaved in rounds.

    .venv/bin/python benchmarks/probes/step_vs_context.py                          # bs 24, 4 lengths (~2 min)
"""

import argparse
import statistics
import time

from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.engine.profiler import filled_drafts
from dynaspec.kpolicy.policy import FixedK
from dynaspec.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--batch-size", type=int, default=24)
    p.add_argument("--contexts", default="40,200,400,800", help="prompt lengths in tokens")
    p.add_argument("--ks", default="0,1,5")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    engine = Engine(
        EngineConfig(
            model=args.model,
            speculative_config={"method": "ngram", "num_speculative_tokens": max(ks)},
            max_num_seqs=args.batch_size,
            max_num_batched_tokens=2048,
            progress=False,
        )
    )
    params = SamplingParams(
        max_tokens=8 * len(ks) * args.rounds * (max(ks) + 1), temperature=0.0, ignore_eos=True
    )
    print(f"bs {args.batch_size}: median step ms at each K")
    print(f"{'context':>8} " + " ".join(f"{'K=' + str(k):>8}" for k in ks))
    for context in (int(c) for c in args.contexts.split(",")):
        requests = [
            engine.add_request([((i + j) * 7919) % 5000 + 100 for i in range(context)], params)
            for j in range(args.batch_size)
        ]
        engine.set_k_policy(FixedK(0))
        while not all(r.is_decoding for r in requests):
            engine.step()
        times: dict[int, list[float]] = {k: [] for k in ks}
        with filled_drafts(engine):
            for rnd in range(args.rounds):
                for k in ks if rnd % 2 == 0 else ks[::-1]:
                    engine.set_k_policy(FixedK(k))
                    engine.step()  # warm-up
                    for _ in range(2):
                        start = time.perf_counter()
                        engine.step()
                        times[k].append((time.perf_counter() - start) * 1000)
        for r in requests:
            engine.abort(r.request_id)
        print(f"{context:>8} " + " ".join(f"{statistics.median(times[k]):>8.1f}" for k in ks), flush=True)


if __name__ == "__main__":
    main()
