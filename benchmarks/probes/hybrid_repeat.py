"""A prompt asked again at one request (a retry, an agent's loop, a second epoch), with the draft
pair alone and with suffix matches beside it (``enable_suffix_decoding``): output tok/s of the
first and the second asking, greedy, and which source drafted the second one's tokens. Each
configuration runs on its own engine, interleaved prompt by prompt; the outputs must equal.

    .venv/bin/python benchmarks/probes/hybrid_repeat.py [--dataset humaneval] [--num-prompts 4]
"""

from __future__ import annotations

import argparse
import time

from dynaspec import SamplingParams
from dynaspec.bench.common import format_table
from dynaspec.datasets import load_prompts
from dynaspec.engine.build import build_engine
from dynaspec.engine.engine import EngineConfig

PAIR = {
    "method": "draft_model",
    "model": "qwen2.5-coder-0.5b-instruct",
    "num_speculative_tokens": 5,
    "dynamic_config_path": "auto",
}


def run(engine, prompt, params) -> tuple[list[int], float]:
    start = time.perf_counter()
    r = engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    return r.output_token_ids, len(r.output_token_ids) / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    prompts = load_prompts(args.dataset, chat=True)[: args.num_prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    engines = {
        name: build_engine(EngineConfig(model=args.model, speculative_config=spec, progress=False))
        for name, spec in (("pair", PAIR), ("pair+suffix", PAIR | {"enable_suffix_decoding": True}))
    }
    speeds = {(name, ask): [] for name in engines for ask in (1, 2)}
    texts = {}
    for i, prompt in enumerate(prompts):
        for name, engine in engines.items() if i % 2 == 0 else reversed(engines.items()):
            for ask in (1, 2):
                tokens, speed = run(engine, prompt, params)
                speeds[(name, ask)].append(speed)
                texts.setdefault((i, ask), tokens)
                if tokens != texts[(i, ask)]:
                    raise SystemExit(f"prompt {i}: {name}'s output differs from the other configuration's")
    rows = []
    for (name, ask), values in speeds.items():
        rows.append([name, ask, sum(values) / len(values)])
    print(format_table(["config", "asking", "output tok/s"], rows))
    print("pair+suffix drafting by source:", engines["pair+suffix"].proposer.stats()["sources"])


if __name__ == "__main__":
    main()
