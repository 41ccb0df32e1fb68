"""Issue 37: the host time of an engine step's parts (scheduler, the policy's ``choose`` within it,
proposer, target pass, the policy's ``observe``), fixed K=0 against the per-request policy (128
tokens, 2 rounds), in ms a step. By default the n-gram at one MT-Bench request (4 prompts); or a
drafter (pair or ngram), a dataset and a concurrency (4 prompts a request in flight):

    .venv/bin/python results/zen5/ab37/host_time.py ~/.cache/dynaspec/profiles/<ngram profile>.json
    .venv/bin/python results/zen5/ab37/host_time.py <pair profile>.json pair humaneval 8
"""

import sys
import time

from dynaspec.bench.common import k_policies
from dynaspec.bench.sweep import closed_loop
from dynaspec.datasets import load_prompts
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.kpolicy.profile import load_profile
from dynaspec.sampling_params import SamplingParams


def timed(obj, attr: str, key: str, spent: dict[str, float]) -> None:
    call = getattr(obj, attr)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = call(*args, **kwargs)
        spent[key] = spent.get(key, 0.0) + time.perf_counter() - start
        return out

    setattr(obj, attr, wrapper)


SPECS = {
    "ngram": '{"method":"ngram","num_speculative_tokens":5}',
    "pair": '{"method":"draft_model","model":"qwen2.5-coder-0.5b-instruct","num_speculative_tokens":5}',
}


def main() -> None:
    drafter, dataset, concurrency = (sys.argv[2:] + ["ngram", "mtbench", "1"][len(sys.argv) - 2 :])[:3]
    concurrency = int(concurrency)
    engine = Engine(EngineConfig(model="qwen2.5-coder-1.5b-instruct", speculative_config=SPECS[drafter]))
    makers = k_policies([0], load_profile(sys.argv[1]), 5, 3)
    prompts = load_prompts(dataset, chat=True)[: 4 * concurrency]
    spent: dict[str, float] = {}
    for obj, attr in [
        (engine.scheduler, "schedule"),
        (engine.proposer, "propose"),
        (engine.proposer, "commit"),
        (engine, "_observe"),
        (engine.runner, "forward"),
        (engine.scheduler, "update"),
    ]:
        timed(obj, attr, attr.strip("_"), spent)
    for rnd in range(2):
        for name in ("K=0", "per-request"):
            policy = makers[name]()
            timed(policy, "choose", "choose", spent)
            engine.set_k_policy(policy)
            spent.clear()
            before = engine.counters.num_steps
            wall, requests, _ = closed_loop(
                engine, prompts, concurrency, SamplingParams(max_tokens=128, temperature=0.0)
            )
            steps = engine.counters.num_steps - before
            tokens = sum(len(r.output_token_ids) for r in requests)
            parts = {k: round(1000 * v / steps, 3) for k, v in spent.items()}
            print(
                rnd,
                name,
                f"{tokens / wall:.1f} tok/s",
                steps,
                "steps",
                parts,
                f"wall/step {1000 * wall / steps:.2f}",
            )


if __name__ == "__main__":
    main()
