"""Issue 37: the pair's engine with prefix caching on (a drafter copies a shared block before it
writes its K/V there) against none with it, at eight HumanEval requests: none, the pair at fixed
K=0, per-request and fixed K=2 with the cache, per-request and K=2 without it (the engine before
the copies; at K=2 the drafter drafts, so its blocks are copied); 16 prompts (two waves of 8), 128
tokens, greedy, 3 interleaved rounds, each run from a cold cache. Each run's outputs are checked
against none's (lossless).

    .venv/bin/python results/zen5/pc37/prefix_cache.py ~/.cache/dynaspec/profiles/<pair>.json humaneval
"""

import sys

from dynaspec.bench.common import k_policies
from dynaspec.bench.sweep import closed_loop
from dynaspec.datasets import load_prompts
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.kpolicy.profile import load_profile
from dynaspec.sampling_params import SamplingParams

MODEL = "qwen2.5-coder-1.5b-instruct"
SPEC = '{"method":"draft_model","model":"qwen2.5-coder-0.5b-instruct","num_speculative_tokens":5}'


def main() -> None:
    engines = {
        "none": Engine(EngineConfig(model=MODEL)),
        "spec": Engine(EngineConfig(model=MODEL, speculative_config=SPEC)),
        "spec-nocache": Engine(
            EngineConfig(model=MODEL, speculative_config=SPEC, enable_prefix_caching=False)
        ),
    }
    makers = k_policies([0, 2], load_profile(sys.argv[1]), 5, 3)
    prompts = load_prompts(sys.argv[2], chat=True)[:16]

    want: list[list[int]] = []

    def run(name: str) -> str:
        policy, _, nocache = name.partition(" ")
        engine = engines["none" if name == "none" else "spec-nocache" if nocache else "spec"]
        if name != "none":
            engine.set_k_policy(makers[policy]())
        engine.reset_prefix_cache()
        before = dict(engine.stats()["prefix_cache"])
        wall, requests, _ = closed_loop(engine, prompts, 8, SamplingParams(max_tokens=128, temperature=0.0))
        after = engine.stats()["prefix_cache"]
        cached = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
        copies = after["unshared_blocks"] - before["unshared_blocks"]
        rate = sum(len(r.output_token_ids) for r in requests) / wall
        outputs = [r.output_token_ids for r in requests]
        if not want:
            want.extend(outputs)
        same = outputs == want
        return f"{rate:.1f} tok/s, cached prompt tokens {cached}, blocks copied {copies}, as none's: {same}"

    names = ["none", "K=0", "per-request", "per-request nocache", "K=2", "K=2 nocache"]
    for name in names:  # warm each configuration
        run(name)
    for rnd in range(3):
        for name in names if rnd % 2 == 0 else names[::-1]:
            print(rnd, name.ljust(20), run(name), flush=True)


if __name__ == "__main__":
    main()
