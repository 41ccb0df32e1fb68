"""Per-step trace of the pair's per-request policy on issue 40's long prompts (`longedit`), as a server
keeps one policy: the prompts prefilled into the prefix cache first, a warm-up at one request (where
the policy learns these edits' acceptance), then a closed loop at ``--concurrency``; each step's load,
what each request's drafter still owes (unseen tokens), tokens left, and the drafts chosen.

    .venv/bin/python benchmarks/probes/longedit_trace.py --profile <auto profile> [--concurrency 8] \
        [--configs per-request,ctx-blind] [--out trace.json]                        # (~4 min)
"""

import argparse
import json
from collections import Counter

from dynaspec.bench.common import k_policies
from dynaspec.bench.sweep import closed_loop, warm_prompts
from dynaspec.datasets import load_prompts
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.kpolicy.profile import load_profile
from dynaspec.sampling_params import SamplingParams

SPEC = {"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 5}


def traced(policy, steps: list) -> None:
    """Record each choice's load and drafts into ``steps``."""
    choose = policy.choose

    def spy(candidates):
        k, drafts = choose(candidates)
        steps.append(
            {
                "bs": len(candidates),
                "decoding": sum(c.decoding for c in candidates),
                "unseen": [c.unseen_tokens for c in candidates],
                "left": [c.tokens_left for c in candidates],
                "drafts": list(drafts),
                "alpha0": round(policy.acceptance.rates()[0], 3),
            }
        )
        return k, drafts

    policy.choose = spy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", required=True)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--learn-prompts", type=int, default=2, help="prompts at one request first")
    p.add_argument("--configs", default="per-request,ctx-blind")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out")
    args = p.parse_args()
    profile = load_profile(args.profile)
    prompts = load_prompts("longedit", chat=True)[: args.concurrency + args.learn_prompts]
    engine = Engine(
        EngineConfig(
            model="qwen2.5-coder-1.5b-instruct",
            speculative_config=SPEC,
            enable_prefix_caching=True,
            kv_cache_memory_gb=4,
            max_num_seqs=max(8, args.concurrency),
        )
    )
    warm_prompts(engine, prompts, "spec")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    makers = k_policies([], profile, 5, 3)
    report = {}
    for name in args.configs.split(","):
        policy = makers[name]()
        engine.set_k_policy(policy)
        closed_loop(engine, prompts[: args.learn_prompts], 1, params)
        steps: list = []
        traced(policy, steps)
        wall, requests, _ = closed_loop(engine, prompts[args.learn_prompts :], args.concurrency, params)
        tokens = sum(len(r.output_token_ids) for r in requests)
        ks = Counter(max(s["drafts"]) for s in steps)
        print(
            f"{name}: {tokens / wall:.1f} tok/s, {len(steps)} steps, "
            f"max drafts per step {dict(sorted(ks.items()))}"
        )
        for i, s in enumerate(steps[:12]):
            print(
                f"  step {i}: bs {s['bs']} decoding {s['decoding']} unseen {s['unseen']} left {s['left']} "
                f"drafts {s['drafts']} alpha0 {s['alpha0']}"
            )
        report[name] = {
            "tokens_per_s": tokens / wall,
            "steps": steps,
            "policy": policy.snapshot(),
            "seconds": wall,
        }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
