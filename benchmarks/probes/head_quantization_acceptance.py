"""How an EAGLE-3 head's quantization (``draft_quantization``) changes its acceptance: one engine a
quantization, K=1 on every step, 8 MT-Bench then 8 HumanEval prompts x 128 tokens, greedy (the
acceptance does not depend on timing, so a busy machine gives the same figures).

    .venv/bin/python benchmarks/probes/head_quantization_acceptance.py bench-results/heads/xeon-eagle3 \
        --quantizations int8,int4
"""

from __future__ import annotations

import argparse

from dynaspec.datasets import load_prompts
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.kpolicy.policy import FixedK
from dynaspec.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("head", help="an EAGLE-3 checkpoint directory")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--quantizations", default="int8,int4")
    ap.add_argument("--num-prompts", type=int, default=8)
    args = ap.parse_args()
    for q in args.quantizations.split(","):
        spec = {"method": "eagle3", "model": args.head, "num_speculative_tokens": 1, "draft_quantization": q}
        config = EngineConfig(
            model=args.model, speculative_config=spec, max_num_seqs=8, kv_cache_memory_gb=1.0, progress=False
        )
        engine = Engine(config)
        engine.set_k_policy(FixedK(1))
        accepted = drafted = 0  # the engine's counters run on across datasets
        for dataset in ("mtbench", "humaneval"):
            for prompt in load_prompts(dataset, chat=True)[: args.num_prompts]:
                engine.add_request(prompt, SamplingParams(max_tokens=128, temperature=0.0))
            while engine.has_unfinished():
                engine.step()
            spec_stats = engine.stats()["spec"]
            total = spec_stats["num_accepted_tokens"] / spec_stats["acceptance_rate"]
            drafts = total - drafted
            rate = (spec_stats["num_accepted_tokens"] - accepted) / drafts
            accepted, drafted = spec_stats["num_accepted_tokens"], total
            print(f"{q} {dataset}: first-draft acceptance {rate:.4f} ({drafts:.0f} drafts)", flush=True)


if __name__ == "__main__":
    main()
