"""Drafter catch-up cost: one drafter pass over whole HumanEval chat prompts, 1 to 16 at once.

The goodput policy prices a new request's drafter catch-up at the cost model's ms per catch-up
token; this probe measures that cost directly (the probe quoted in results/RESULTS.md).

    .venv/bin/python benchmarks/catchup_cost.py
"""

import json
import statistics
import time
from pathlib import Path

from dynaspec.datasets import load_prompts
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.engine.runner import TokenRun

SPEC = json.loads((Path(__file__).resolve().parent.parent / "results" / "spec_qwen_pair.json").read_text())
PASS_MS = 40.0  # a drafter pass over a single token, subtracted to leave the per-token part

engine = Engine(EngineConfig(model="qwen2.5-coder-1.5b-instruct", speculative_config=SPEC, progress=False))
prompts = [engine.prompt_token_ids(p) for p in load_prompts("humaneval")[:16]]
blocks_per_prompt = max(len(p) for p in prompts) // engine.config.block_size + 1


def median_ms(fn, repeats: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


for rows in (1, 2, 4, 8, 16):
    runs = [
        TokenRun(prompts[i], 0, list(range(i * blocks_per_prompt, (i + 1) * blocks_per_prompt)), [len(prompts[i]) - 1])
        for i in range(rows)
    ]
    tokens = sum(len(r.token_ids) for r in runs)
    ms = median_ms(lambda: engine.proposer.runner.run(runs))
    print(f"rows {rows:2d} tokens {tokens:5d}: {ms:8.1f} ms  {(ms - PASS_MS) / (tokens - rows):.2f} ms per catch-up token")
