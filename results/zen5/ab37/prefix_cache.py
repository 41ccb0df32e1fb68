"""Issue 37: what prefix caching is worth to none at eight HumanEval requests, beside the pair's
engine (a draft model keeps its K/V in the requests' block tables, so its engine runs without
prefix caching): none, none without prefix caching, the pair at fixed K=0 and per-request;
16 prompts (two waves of 8), 128 tokens, greedy, 3 interleaved rounds, each run from a cold cache.

    .venv/bin/python results/zen5/ab37/prefix_cache.py ~/.cache/dynaspec/profiles/<pair>.json humaneval
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
        "none-nocache": Engine(EngineConfig(model=MODEL, enable_prefix_caching=False)),
        # the pair without prefix caching, as its engine ran before 81c823d (now the default is on)
        "spec": Engine(EngineConfig(model=MODEL, speculative_config=SPEC, enable_prefix_caching=False)),
    }
    makers = k_policies([0], load_profile(sys.argv[1]), 5, 3)
    prompts = load_prompts(sys.argv[2], chat=True)[:16]

    def run(name: str) -> tuple[float, int]:
        engine = engines["spec" if name in makers else name]
        if name in makers:
            engine.set_k_policy(makers[name]())
        engine.reset_prefix_cache()
        wall, requests, _ = closed_loop(engine, prompts, 8, SamplingParams(max_tokens=128, temperature=0.0))
        return sum(len(r.output_token_ids) for r in requests) / wall, engine.counters.num_cached_prompt_tokens

    for name in ("none", "none-nocache", "K=0"):  # warm each engine
        run(name)
    names = ["none", "none-nocache", "K=0", "per-request"]
    for rnd in range(3):
        for name in names if rnd % 2 == 0 else names[::-1]:
            rate, cached = run(name)
            print(rnd, name.ljust(13), f"{rate:.1f} tok/s, cached prompt tokens so far {cached}", flush=True)


if __name__ == "__main__":
    main()
