"""Time the row-wise paged attention operator alone (csrc/attention.cpp) on the 1.5B target's heads
(12 query heads, 2 KV heads of 128; float32 cache), per layer and for its 28 layers, with the rate
in GFLOP/s (two multiply-adds per head element per key): a verify step (24 sequences of 6 rows), a
plain decode step (24 of 1) at 800 tokens of context and at 40, and a 200-token prefill chunk.

    .venv/bin/python benchmarks/attention_kernel.py          # seconds
"""

import torch

from dynaspec.bench.common import ms_per_call
from dynaspec.models.kernels import kernel_error

HEADS, KV_HEADS, D, LAYERS = 12, 2, 128, 28
CASES = [(800, 6, 24), (800, 1, 24), (40, 6, 24), (0, 200, 1)]  # (context, new rows, sequences)


def main() -> None:
    if kernel_error() is not None:
        raise SystemExit(kernel_error())
    print(f"{'context':>8} {'rows':>5} {'seqs':>5} {'ms/layer':>9} {'ms/step':>8} {'GFLOP/s':>8}")
    for ctx, new, seqs in CASES:
        total = seqs * (ctx + new)
        k_cache, v_cache = torch.randn(total, KV_HEADS, D), torch.randn(total, KV_HEADS, D)
        table = torch.arange(total).view(seqs, ctx + new)
        row_seq = torch.arange(seqs).repeat_interleave(new)
        row_len = torch.arange(ctx + 1, ctx + new + 1).repeat(seqs)
        q = torch.randn(seqs * new, HEADS, D)

        args = (q, k_cache, v_cache, table, row_seq, row_len, D**-0.5)
        ms = ms_per_call(lambda args=args: torch.ops.dynaspec.paged_attention_rows(*args), 10)
        gflops = int(row_len.sum()) * HEADS * D * 4 / ms / 1e6
        print(f"{ctx:>8} {new:>5} {seqs:>5} {ms:>9.2f} {ms * LAYERS:>8.0f} {gflops:>8.1f}")


if __name__ == "__main__":
    main()
