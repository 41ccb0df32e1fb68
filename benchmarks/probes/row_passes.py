"""Does a profile's first row time slower than the same row later? The draft pair's ITL(bs, K)
rows for the auto profile's first batch sizes, timed in passes (each pass: every batch size in
turn, one round of every K, fresh requests), so each row's figure can be read pass by pass.

    .venv/bin/python benchmarks/probes/row_passes.py [--passes 6] [--batch-sizes 1,2,4] [--out F.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from dynaspec.datasets import load_prompts
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.engine.profiler import auto_settings, measure_itl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--passes", type=int, default=6)
    ap.add_argument("--batch-sizes", default="1,2,4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = {"method": "draft_model", "model": args.drafter, "num_speculative_tokens": 5}
    engine = Engine(EngineConfig(model=args.model, speculative_config=spec, progress=False))
    prompts = load_prompts("mixed", chat=True)
    base = auto_settings(5, engine.config.max_num_seqs)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows: list[dict] = []
    for p in range(args.passes):
        for bs in sizes:
            settings = dataclasses.replace(
                base,
                batch_sizes=[bs],
                rounds=1,
                dense_batch_sizes=0,
                measured_steps=3,
                revisits=0,
                close_rounds=0,
            )
            row = measure_itl(engine, prompts, settings, progress=False)[bs]
            rows.append({"pass": p, "bs": bs, "ms": row})
            cells = " ".join(f"{row[k]:6.1f}" for k in sorted(row))
            print(f"pass {p} bs {bs:2d}: {cells}", flush=True)
    print("\nmedian over passes, and the spread (max / min) of K=0 and K=3:")
    for bs in sizes:
        mine = [r["ms"] for r in rows if r["bs"] == bs]
        med = {k: statistics.median(m[k] for m in mine) for k in mine[0]}
        spread = {k: max(m[k] for m in mine) / min(m[k] for m in mine) for k in (0, 3)}
        print(f"bs {bs:2d}: " + " ".join(f"{med[k]:6.1f}" for k in sorted(med)) + f"   spread {spread}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"passes": rows}, f, indent=1)


if __name__ == "__main__":
    main()
