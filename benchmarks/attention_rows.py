"""What paged attention costs a layer at a long context, for the pair's head shapes: the 1.5B's 12
query heads over 2 KV heads of 128 and the 0.5B's 14 over 2 of 64, a bfloat16 cache, one row or a
verified window (the figures behind results/RESULTS.md, "What a tail step costs"). Best of 5
rounds of 50 calls.

    .venv/bin/python benchmarks/attention_rows.py [--context 2000]
"""

from __future__ import annotations

import argparse
import time

import torch

from dynaspec.bench.common import format_table
from dynaspec.models.kernels import kernel_error

SHAPES = (  # name, query heads, KV heads, head size, rows (of one sequence)
    ("1.5B target, 1 row", 12, 2, 128, 1),
    ("1.5B target, verify K=3 (4 rows)", 12, 2, 128, 4),
    ("0.5B drafter, 1 row", 14, 2, 64, 1),
)


def best_seconds(inputs: tuple) -> float:
    """Seconds a call, the best of 5 rounds of 50 after 20 to warm up."""
    for _ in range(20):
        torch.ops.dynaspec.paged_attention_rows(*inputs)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(50):
            torch.ops.dynaspec.paged_attention_rows(*inputs)
        best = min(best, (time.perf_counter() - t0) / 50)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=2000)
    args = p.parse_args()
    if (error := kernel_error()) is not None:
        raise SystemExit(f"the C++ kernels are not available: {error}")
    torch.manual_seed(0)
    rows = []
    for name, heads, kv_heads, d, n in SHAPES:
        slots = args.context + 64
        k_cache = torch.randn(slots, kv_heads, d).bfloat16()
        v_cache = torch.randn(slots, kv_heads, d).bfloat16()
        table = torch.randperm(slots)[None, :].contiguous()
        q = torch.randn(n, heads, d)
        row_seq = torch.zeros(n, dtype=torch.long)
        row_len = torch.arange(args.context, args.context + n)
        inputs = (q, k_cache, v_cache, table, row_seq, row_len, d**-0.5)
        best = best_seconds(inputs)
        flops = 4 * n * heads * d * args.context  # q.k and p.v, a multiply and an add each
        rows.append([name, f"{best * 1000:.3f}", f"{flops / best / 1e9:.0f}"])
    print(f"context {args.context}, bfloat16 cache, {torch.get_num_threads()} threads")
    print(format_table(["shape", "ms a layer", "GFLOP/s"], rows))


if __name__ == "__main__":
    main()
