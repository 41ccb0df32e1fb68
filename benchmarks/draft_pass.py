"""Where one drafter pass goes (results/RESULTS.md, "n-gram drafts take plain decoding's draws"):
the pair's drafter (Qwen2.5-Coder 0.5B, its head cut to 32768 ids as in results/spec_qwen_pair.json)
runs one token for 1 and for 4 requests at position 300; the pass's time, the time inside torch
ops (the quantized matmul apart) and outside them (Python and dispatch), and the per-op table.

    .venv/bin/python benchmarks/draft_pass.py [--model qwen2.5-coder-0.5b-instruct] [--head-rows 32768]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from dynaspec.bench.common import ms_per_call
from dynaspec.engine.runner import ModelRunner, TokenRun
from dynaspec.models.build import effective_quantization
from dynaspec.models.loader import compute_dtypes, load_model, resolve_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--head-rows", type=int, default=32768)
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()
    cpu = torch.device("cpu")
    source = resolve_model(args.model)
    dtype, kv_dtype = compute_dtypes("auto", effective_quantization("auto", source.is_gguf, cpu))
    model = load_model(source, "auto", dtype, cpu, head_rows=args.head_rows)
    runner = ModelRunner(model, 4096, 16, kv_dtype, cpu)
    blocks = list(range(40))
    runner.run([TokenRun(list(range(100, 400)), 0, blocks, [299])])  # a 300-token context
    for rows in (1, 4):
        runs = [TokenRun([500], 300, blocks, [0]) for _ in range(rows)]
        ms = ms_per_call(lambda runs=runs: runner.run(runs), args.steps)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                runner.run(runs)
        ops = prof.key_averages()
        qmm = sum(k.self_cpu_time_total for k in ops if k.key == "dynaspec::qmm_vnni") / 10_000
        calls = sum(k.count for k in ops if k.key == "dynaspec::qmm_vnni") // 10
        inside = sum(k.self_cpu_time_total for k in ops) / 10_000
        print(
            f"{rows} row(s): a pass {ms:.2f} ms; inside torch ops {inside:.2f} (quantized matmul {qmm:.2f} "
            f"in {calls} calls, other ops {inside - qmm:.2f}); outside them {ms - inside:.2f}"
        )
        print(ops.table(sort_by="self_cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()
