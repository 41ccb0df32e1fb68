"""What the target's hidden states (for an EAGLE head) cost a step: the target's pass with capture
off (``ModelRunner.run``, the path every step takes when no EAGLE proposer runs) against the same
pass capturing EAGLE-3's three layers (``run_capture``), per forward shape, at context 300; and
what the off path adds to a step in the engine (a truthiness check and the proposer's no-op
``read_hidden``), timed on its own. Rounds alternate the paths; the table keeps each one's fastest.

    .venv/bin/python benchmarks/probes/eagle_hidden_cost.py [--model NAME] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import time

import torch

from dynaspec.bench.common import environment, format_table, ms_per_call, write_result
from dynaspec.engine.runner import ModelRunner, TokenRun
from dynaspec.engine.types import Drafts, SchedulePlan
from dynaspec.models.build import effective_quantization
from dynaspec.models.loader import compute_dtypes, load_model, resolve_model
from dynaspec.spec_decode.eagle_head import default_aux_layers
from dynaspec.spec_decode.proposer import Proposer, ProposerContext

SHAPES = {"1 row": (1, 1), "4 rows": (4, 1), "verify K=5": (1, 6)}  # (requests, tokens each)
CONTEXT = 300


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.threads:  # on a CPU other jobs share, fewer threads than cores keeps OpenMP from stalling
        torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    source = resolve_model(args.model)
    dtype, kv_dtype = compute_dtypes("auto", effective_quantization("auto", source.is_gguf, cpu))
    model = load_model(source, "auto", dtype, cpu)
    layers = default_aux_layers(model.config.num_hidden_layers)
    runner = ModelRunner(model, 4 * 40 * 16, 16, kv_dtype, cpu)
    tables = [list(range(i * 40, (i + 1) * 40)) for i in range(4)]
    for table in tables:  # a 300-token context for each request
        runner.run([TokenRun(list(range(100, 100 + CONTEXT)), 0, table, [CONTEXT - 1])])
    rows, results = [], []
    for label, (requests, tokens) in SHAPES.items():
        runs = [
            TokenRun(list(range(500, 500 + tokens)), CONTEXT, tables[i], list(range(tokens)))
            for i in range(requests)
        ]
        best = {"off": float("inf"), "on": float("inf")}
        for _ in range(args.rounds):
            off = ms_per_call(lambda runs=runs: runner.run(runs), args.steps)
            on = ms_per_call(lambda runs=runs: runner.run_capture(runs, layers), args.steps)
            best = {"off": min(best["off"], off), "on": min(best["on"], on)}
        extra = (best["on"] / best["off"] - 1) * 100
        rows.append([label, f"{best['off']:.2f}", f"{best['on']:.2f}", f"{extra:+.1f}%"])
        print(*rows[-1], flush=True)
        results.append(
            {"shape": label, "off_ms": best["off"], "capture_ms": best["on"], "capture_pct": extra}
        )
    # the off path's own additions to Engine.step: `if self.hidden_layers` and read_hidden's no-op
    proposer = Proposer(ProposerContext(None, dtype, cpu, 16))
    plan = SchedulePlan([], [], [])
    drafts = Drafts(torch.zeros(0, 0, dtype=torch.long), [])
    n = 100_000
    start = time.perf_counter()
    for _ in range(n):
        if runner.hidden_layers:
            raise AssertionError("capture is on")
        proposer.read_hidden(plan, drafts, None)
    off_us = (time.perf_counter() - start) / n * 1e6
    step_ms = results[0]["off_ms"]
    print(format_table(["shape", "capture off ms", "3 layers captured ms", "capture costs"], rows))
    share = off_us / (step_ms * 1e3) * 100
    print(f"capture off, the step's additions: {off_us:.3f} us = {share:.4f}% of a 1-row step")
    write_result(
        args.out,
        {
            "probe": "eagle_hidden_cost",
            "model": args.model,
            "layers": list(layers),
            "context": CONTEXT,
            "threads": torch.get_num_threads(),
            "shapes": results,
            "off_path_us": off_us,
            "off_path_pct_of_1_row_step": share,
            "environment": environment(),
        },
    )


if __name__ == "__main__":
    main()
