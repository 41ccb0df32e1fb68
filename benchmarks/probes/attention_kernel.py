"""Time the row-wise paged attention operator alone (csrc/attention.cpp), per layer and for a
model's layers, with the rate in GFLOP/s (two multiply-adds per head element per key). By default
on the 1.5B target's heads (12 query heads, 2 KV heads of 128; float32 cache): a verify step (24
sequences of 6 rows), a plain decode step (24 of 1) at 800 tokens of context and at 40, and a
200-token prefill chunk. With --tail N, a rollout's tail at N tokens of context: one sequence's
row and its K=3 window (4 rows) on the target, and one row on the 0.5B drafter's heads (14 over 2
KV heads of 64, 24 layers). With --cold, every layer has a cache of its own and a call goes
through them all, as a step does, so the cache comes from memory rather than from L2/L3.

    .venv/bin/python benchmarks/probes/attention_kernel.py          # seconds
    .venv/bin/python benchmarks/probes/attention_kernel.py --tail 2000 --cache bfloat16 --calls 500
    .venv/bin/python benchmarks/probes/attention_kernel.py --tail 8000 --cache bfloat16 --cold --calls 20
"""

import argparse

import torch

from dynaspec.bench.common import ms_per_call
from dynaspec.models.kernels import kernel_error

TARGET = ("1.5B", 12, 2, 128, 28)  # model, query heads, KV heads, head size, layers
DRAFTER = ("0.5B", 14, 2, 64, 24)
CASES = [(TARGET, 800, 6, 24), (TARGET, 800, 1, 24), (TARGET, 40, 6, 24), (TARGET, 0, 200, 1)]
# (model, context, new rows, sequences)


def tail_cases(context: int) -> list:
    return [(TARGET, context, 1, 1), (TARGET, context, 4, 1), (DRAFTER, context, 1, 1)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tail", type=int, default=0, help="time a rollout's tail at this context instead")
    p.add_argument("--cache", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--cold", action="store_true", help="a cache per layer, read in turn (from memory)")
    args = p.parse_args()
    if kernel_error() is not None:
        raise SystemExit(kernel_error())
    dtype = getattr(torch, args.cache)
    header = ("model", "context", "rows", "seqs", "ms/layer", "ms/step", "GFLOP/s")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (5, 8, 5, 5, 9, 8, 8))))
    for (model, heads, kv_heads, d, layers), ctx, new, seqs in tail_cases(args.tail) if args.tail else CASES:
        total = seqs * (ctx + new)
        caches = [
            (torch.randn(total, kv_heads, d).to(dtype), torch.randn(total, kv_heads, d).to(dtype))
            for _ in range(layers if args.cold else 1)
        ]
        table = torch.arange(total).view(seqs, ctx + new)
        row_seq = torch.arange(seqs).repeat_interleave(new)
        row_len = torch.arange(ctx + 1, ctx + new + 1).repeat(seqs)
        q = torch.randn(seqs * new, heads, d)

        def call(q=q, caches=caches, table=table, row_seq=row_seq, row_len=row_len, d=d) -> None:
            for k_cache, v_cache in caches:
                torch.ops.dynaspec.paged_attention_rows(q, k_cache, v_cache, table, row_seq, row_len, d**-0.5)

        ms = ms_per_call(call, args.calls) / len(caches)
        gflops = int(row_len.sum()) * heads * d * 4 / ms / 1e6
        print(f"{model:>5} {ctx:>8} {new:>5} {seqs:>5} {ms:>9.3f} {ms * layers:>8.1f} {gflops:>8.1f}")


if __name__ == "__main__":
    main()
