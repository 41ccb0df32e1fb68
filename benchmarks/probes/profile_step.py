"""Where one decode step's time goes: engine step time at a batch size, the torch profiler's per-op
table over a few steps, and the output head alone (the figures behind `git show
e12b4e2:results/RESULTS.md`, "Where a batch-1 step goes").

    .venv/bin/python benchmarks/probes/profile_step.py [--batch-size 1] [--model qwen2.5-coder-1.5b-instruct]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from dynaspec import SamplingParams
from dynaspec.bench.common import ms_per_call
from dynaspec.engine.engine import Engine, EngineConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    engine = Engine(EngineConfig(model=args.model, progress=False, kv_cache_memory_gb=0.5))
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Write a quicksort in Python."}])
    params = SamplingParams(max_tokens=10**4, temperature=0.0, ignore_eos=True)
    for _ in range(args.batch_size):
        engine.add_request(ids, params)
    for _ in range(10):  # prefill and warm-up
        engine.step()
    step_ms = ms_per_call(engine.step, args.steps)
    print(f"batch {args.batch_size}: {step_ms:.1f} ms per step, {args.batch_size * 1000 / step_ms:.1f} tok/s")
    hidden = torch.randn(args.batch_size, engine.model_config.hidden_size)
    head_ms = ms_per_call(lambda: engine.runner.model.compute_logits(hidden), args.steps)
    print(f"output head alone: {head_ms:.1f} ms")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            engine.step()
    print("per-op, 5 steps:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


if __name__ == "__main__":
    main()
