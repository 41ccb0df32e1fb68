"""The decoder stack as one C++ call (csrc/layer.cpp) against the module path, per forward shape:
for the pair's drafter (head cut to 32768 ids, as the profiles run it) and its target, one pass of
1 decode row, 4 and 16 decode rows, and one request verifying 6 tokens (K=5), at context 300.
Rounds alternate the two paths; the table keeps each path's fastest round. Also checks that both
give bitwise the same logits.

    .venv/bin/python benchmarks/probes/decoder_stack.py [--out bench-results/decoder_stack.json]
"""

from __future__ import annotations

import argparse
import functools

import torch

from dynaspec.bench.common import environment, format_table, ms_per_call, write_result
from dynaspec.engine.runner import ModelRunner, TokenRun
from dynaspec.models.build import effective_quantization
from dynaspec.models.loader import compute_dtypes, load_model, resolve_model

MODELS = (("qwen2.5-coder-0.5b-instruct", 32768), ("qwen2.5-coder-1.5b-instruct", None))
SHAPES = {
    "1 row": (1, 1),
    "4 rows": (4, 1),
    "16 rows": (16, 1),
    "verify K=5": (1, 6),
}  # (requests, tokens each)
CONTEXT = 300


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cpu = torch.device("cpu")
    rows, results = [], []
    for name, head_rows in MODELS:
        source = resolve_model(name)
        dtype, kv_dtype = compute_dtypes("auto", effective_quantization("auto", source.is_gguf, cpu))
        model = load_model(source, "auto", dtype, cpu, head_rows=head_rows)
        runner = ModelRunner(model, 16 * 40 * 16, 16, kv_dtype, cpu)
        tables = [list(range(i * 40, (i + 1) * 40)) for i in range(16)]
        for table in tables:  # a 300-token context for each request
            runner.run([TokenRun(list(range(100, 100 + CONTEXT)), 0, table, [CONTEXT - 1])])
        logits = {}
        for use in (False, True):
            model.use_stack = use
            runs = [TokenRun([500, 501, 502], CONTEXT, tables[0], [0, 1, 2])]
            logits[use] = runner.run(runs)
        same = torch.equal(logits[False], logits[True])
        for label, (requests, tokens) in SHAPES.items():
            runs = [
                TokenRun(list(range(500, 500 + tokens)), CONTEXT, tables[i], list(range(tokens)))
                for i in range(requests)
            ]
            best = {False: float("inf"), True: float("inf")}
            for _ in range(args.rounds):
                for use in (False, True):
                    model.use_stack = use
                    best[use] = min(best[use], ms_per_call(functools.partial(runner.run, runs), args.steps))
            ratio = best[False] / best[True]
            rows.append([name, label, f"{best[False]:.2f}", f"{best[True]:.2f}", f"{ratio:.2f}x", same])
            results.append(
                {
                    "model": name,
                    "shape": label,
                    "modules_ms": best[False],
                    "stack_ms": best[True],
                    "same_logits": same,
                }
            )
            print(rows[-1], flush=True)
    print(format_table(["model", "pass", "modules ms", "one C++ call ms", "speed-up", "same logits"], rows))
    write_result(args.out, {"environment": environment(), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
