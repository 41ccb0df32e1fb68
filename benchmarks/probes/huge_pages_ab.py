"""Weights in 2 MiB pages against 4 KiB pages, in one process (`dynaspec.models.hugepages`): the
engine's decode steps with the target's (and a drafter's) weights moved, round by round, into a
mapping advised for huge pages or against them. The layout is the same in both; only the pages
differ, so the VM's drift between processes does not enter. Rounds go small, huge, huge, small
(ABBA), repeated; prints each round and the medians, and writes JSON with --out.

    .venv/bin/python benchmarks/probes/huge_pages_ab.py [--batch-sizes 1,8] [--rounds 2] \
        [--speculative-config '{"method": "draft_model", ...}'] [--out results/.../huge_pages_ab.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch import nn

from dynaspec import SamplingParams
from dynaspec.bench.common import ms_per_call
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.models.hugepages import place_on_huge_pages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--speculative-config", default=None, help="JSON; its drafter's weights move too")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--steps", type=int, default=30, help="engine steps timed per batch size and round")
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds (4 placements each)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    engine = Engine(
        EngineConfig(model=args.model, speculative_config=spec, kv_cache_memory_gb=0.5, progress=False)
    )
    owners = [engine.runner.model] + [v for v in vars(engine.proposer).values() if isinstance(v, nn.Module)]
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Write a quicksort in Python."}])
    params = SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    for round_ in range(args.rounds):
        for huge in (False, True, True, False):
            placements = [place_on_huge_pages([m], engine.device, huge=huge) for m in owners]
            for m, p in zip(owners, placements):
                m.huge_pages = p  # the earlier mapping goes
            resident = sum(p.huge_bytes or 0 for p in placements if p is not None)
            row = {"round": round_ + 1, "pages": "2 MiB" if huge else "4 KiB", "huge_bytes": resident}
            for bs in sizes:
                requests = [engine.add_request(ids, params) for _ in range(bs)]
                while not all(r.is_decoding for r in requests):
                    engine.step()
                for _ in range(5):
                    engine.step()
                row[f"bs{bs}_tok_s"] = round(bs * 1000 / ms_per_call(engine.step, args.steps), 2)
                for r in requests:
                    engine.abort(r.request_id)
                while engine.has_unfinished():
                    engine.step()
            rows.append(row)
            print(" ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    summary = {}
    for bs in sizes:
        key = f"bs{bs}_tok_s"
        small = statistics.median(r[key] for r in rows if r["pages"] == "4 KiB")
        huge = statistics.median(r[key] for r in rows if r["pages"] == "2 MiB")
        summary[f"bs{bs}"] = {"4KiB": small, "2MiB": huge, "ratio": round(huge / small, 3)}
        print(f"batch {bs}: 4 KiB {small:.2f} tok/s, 2 MiB {huge:.2f} tok/s, {huge / small:.3f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rounds": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
