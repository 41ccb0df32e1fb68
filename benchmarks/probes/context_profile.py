"""The quick (auto) profile of an engine with its context axis, written where you say, with the
seconds each part took (``meta.seconds``): how much the axis adds to the auto profile's time.

    .venv/bin/python benchmarks/probes/context_profile.py results/zen3/profile_pair_context.json \
        --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import json

from dynaspec.datasets import load_prompts
from dynaspec.engine.build import build_engine
from dynaspec.engine.engine import EngineConfig
from dynaspec.engine.profiler import auto_settings, run_profile
from dynaspec.kpolicy.profile import save_profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="a draft model, or 'ngram'")
    ap.add_argument("--max-k", type=int, default=5)
    ap.add_argument("--context-lengths", default="4096", help="'' for the auto profile without the axis")
    args = ap.parse_args()
    spec = {"method": "ngram"} if args.draft == "ngram" else {"method": "draft_model", "model": args.draft}
    spec["num_speculative_tokens"] = args.max_k
    engine = build_engine(EngineConfig(model=args.model, speculative_config=spec))
    settings = auto_settings(args.max_k, engine.config.max_num_seqs)
    settings.context_lengths = tuple(int(c) for c in args.context_lengths.split(",") if c.strip())
    meta = {
        "model": args.model,
        "speculative_config": spec,
        "dataset": "mixed",
        "settings_from": "auto_settings",
    }
    profile = run_profile(engine, load_prompts("mixed", chat=True), settings, meta)
    save_profile(profile, args.output)
    seconds = profile.meta["seconds"]
    print(
        json.dumps(
            {"seconds": seconds, "context_cost": profile.context_cost, "context_stats": profile.context_stats}
        )
    )
    spent = sum(v for k, v in seconds.items() if k != "context")
    print(
        f"context axis: {seconds['context']:.0f} s on top of {spent:.0f} s "
        f"(+{100 * seconds['context'] / spent:.0f}%)"
    )


if __name__ == "__main__":
    main()
