"""Issue 37: the per-request policy's host time a step (its ``choose``) with the n-gram at one
MT-Bench request, beside none, fixed K=0 and K=2 (4 prompts, 128 tokens, 2 rounds), then a
cProfile of one per-request run.

    .venv/bin/python results/zen5/ab37/choose_time.py ~/.cache/dynaspec/profiles/<ngram profile>.json
"""

import cProfile
import pstats
import sys
import time

from dynaspec.bench.common import k_policies
from dynaspec.bench.sweep import closed_loop
from dynaspec.datasets import load_prompts
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.sampling_params import SamplingParams

MODEL = "qwen2.5-coder-1.5b-instruct"


def tokens_per_s(engine, policy, prompts) -> float:
    if policy is not None:
        engine.set_k_policy(policy)
    wall, requests, _ = closed_loop(engine, prompts, 1, SamplingParams(max_tokens=128, temperature=0.0))
    return sum(len(r.output_token_ids) for r in requests) / wall


def timed(policy, spent: list[float]):
    """``policy`` with its ``choose`` timed into ``spent`` ([seconds, calls])."""
    choose = policy.choose

    def wrapper(candidates):
        start = time.perf_counter()
        out = choose(candidates)
        spent[0] += time.perf_counter() - start
        spent[1] += 1
        return out

    policy.choose = wrapper
    return policy


def main() -> None:
    from dynaspec.kpolicy.profile import load_profile

    spec = '{"method":"ngram","num_speculative_tokens":5}'
    engine = Engine(EngineConfig(model=MODEL, speculative_config=spec))
    plain = Engine(EngineConfig(model=MODEL))
    makers = k_policies([0, 2], load_profile(sys.argv[1]), 5, 3)
    prompts = load_prompts("mtbench", chat=True)[:4]
    tokens_per_s(engine, makers["K=0"](), prompts[:1])  # warm both engines
    tokens_per_s(plain, None, prompts[:1])
    for rnd in range(2):
        print(rnd, "none", round(tokens_per_s(plain, None, prompts), 2))
        for name in ("K=0", "per-request", "K=2"):
            spent = [0.0, 0]
            rate = tokens_per_s(engine, timed(makers[name](), spent), prompts)
            per_step = 1000 * spent[0] / max(1, spent[1])
            print(rnd, name, round(rate, 2), "choose ms/step", round(per_step, 3), spent[1])
    profiler = cProfile.Profile()
    policy = makers["per-request"]()
    profiler.runcall(tokens_per_s, engine, policy, prompts)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
