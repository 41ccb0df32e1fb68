"""Where one drafter pass goes (`git show e12b4e2:results/RESULTS.md`, "n-gram drafts take plain decoding's
draws" and "A 4-bit drafter by default"): the pair's drafter (Qwen2.5-Coder 0.5B, its head cut to 32768 ids
as in results/spec_qwen_pair.json) runs one token for 1, 2 and 4 requests at position 300.

- For each of ``--quantizations`` (alternating, ``--rounds`` times): the weights' bytes and the
  pass's time, and the time of its matrices alone (every projection and the head called one after
  another on random rows: what streaming the weights costs).
- With ``--ops``: for the first quantization, the time inside torch ops (the quantized matmul apart)
  and outside them (Python and dispatch), and the per-op table (the module path, without the one-call
  decoder stack).

    .venv/bin/python benchmarks/probes/draft_pass.py [--quantizations int4,auto] [--rounds 3] [--ops]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from dynaspec.bench.common import format_table, ms_per_call
from dynaspec.engine.runner import ModelRunner, TokenRun
from dynaspec.models.build import effective_quantization
from dynaspec.models.loader import compute_dtypes, load_model, resolve_model

ROWS = (1, 2, 4)
BLOCKS = list(range(40))


def drafter(args, quantization: str):
    cpu = torch.device("cpu")
    source = resolve_model(args.model)
    dtype, kv_dtype = compute_dtypes("auto", effective_quantization(quantization, source.is_gguf, cpu))
    model = load_model(source, quantization, dtype, cpu, head_rows=args.head_rows)
    runner = ModelRunner(model, 4096, 16, kv_dtype, cpu)
    runner.run([TokenRun(list(range(100, 400)), 0, BLOCKS, [299])])  # a 300-token context
    return model, runner


def matrices(model) -> list:
    out = [model.lm_head]
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        out += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    return out


def width(layer) -> int:
    """A layer's input width (a ConcatLinear's parts share it)."""
    return layer.in_features if hasattr(layer, "in_features") else layer.parts[0].in_features


def timings(model, runner, steps: int) -> list[str]:
    cells = []
    layers = matrices(model)
    for rows in ROWS:
        runs = [TokenRun([500], 300, BLOCKS, [0]) for _ in range(rows)]
        xs = [torch.randn(rows, width(m)) for m in layers]

        def alone(xs=xs):
            with torch.inference_mode():
                for m, x in zip(layers, xs):
                    m(x)

        cells.append(f"{ms_per_call(lambda runs=runs: runner.run(runs), steps):.2f}")
        cells.append(f"{ms_per_call(alone, steps):.2f}")
    return cells


def op_table(runner, steps: int) -> None:
    runner.model.use_stack = False  # the modules, so that the profiler sees each op
    for rows in (1, 4):
        runs = [TokenRun([500], 300, BLOCKS, [0]) for _ in range(rows)]
        ms = ms_per_call(lambda runs=runs: runner.run(runs), steps)
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--head-rows", type=int, default=32768)
    p.add_argument("--quantizations", default="int4,auto", help="the drafter's --quantization, each")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ops", action="store_true", help="also the per-op table of the module path")
    args = p.parse_args()
    models = {q: drafter(args, q) for q in args.quantizations.split(",")}
    table = []
    for r in range(args.rounds):
        for q, (model, runner) in models.items():
            nbytes = sum(b.numel() * b.element_size() for m in matrices(model) for b in m.buffers())
            table.append([r + 1, q, f"{nbytes / 1e6:.0f}"] + timings(model, runner, args.steps))
    headers = ["round", "quantization", "matrices MB"]
    headers += [f"{n} row{'s' * (n > 1)} {what}" for n in ROWS for what in ("pass ms", "matrices ms")]
    print(format_table(headers, table))
    if args.ops:
        op_table(next(iter(models.values()))[1], args.steps)


if __name__ == "__main__":
    main()
