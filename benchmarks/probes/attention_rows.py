"""The row-wise attention kernel alone (`paged_attention_rows`, bfloat16 cache): ms per layer call
for 1-6 query rows of one or two sequences over a long context, the 1.5B's head shapes (12 query
heads, 2 KV heads, 128 dims), each call on a cache no recent call read. Shows what a verified row costs in
attention against the first row.

    .venv/bin/python benchmarks/probes/attention_rows.py [--context 2400] [--out F.json]
"""

from __future__ import annotations

import argparse
import itertools

import torch

from dynaspec.bench.common import environment, format_table, median_ms, write_result
from dynaspec.models import kernels

COPIES = 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2400)
    ap.add_argument("--rows", default="1,2,4,6")
    ap.add_argument("--seqs", default="1,2")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    error = kernels.kernel_error()
    if error is not None:
        raise SystemExit(f"the C++ kernels did not load: {error}")
    torch.set_num_threads(args.threads)
    seqs_list = [int(s) for s in args.seqs.split(",")]
    rows_list = [int(r) for r in args.rows.split(",")]
    span = args.context + 16
    # the calls cycle through COPIES caches, as a step's 28 layers each read their own: a cache read
    # again at once would sit in L2, which no layer of a real step finds
    shape = (span * max(seqs_list) * COPIES, args.kv_heads, args.head_dim)
    kc = (torch.randn(shape) * 0.5).to(torch.bfloat16)
    vc = (torch.randn(shape) * 0.5).to(torch.bfloat16)
    results, table = [], []
    for seqs in seqs_list:
        for rows in rows_list:
            slots = [
                torch.stack([torch.arange(s * span, s * span + args.context) for s in range(seqs)])
                + c * span * max(seqs_list)
                for c in range(COPIES)
            ]
            turn = itertools.count()
            row_seq = torch.tensor([s for s in range(seqs) for _ in range(rows)])
            row_len = torch.tensor([args.context - rows + 1 + i for _ in range(seqs) for i in range(rows)])
            q = torch.randn(rows * seqs, args.heads, args.head_dim)
            scale = args.head_dim**-0.5

            def call(q=q, slots=slots, row_seq=row_seq, row_len=row_len, scale=scale, turn=turn):
                table = slots[next(turn) % COPIES]
                return torch.ops.dynaspec.paged_attention_rows(q, kc, vc, table, row_seq, row_len, scale)

            ms = min(median_ms(call, 20) for _ in range(3))
            results.append({"seqs": seqs, "rows": rows, "ms": ms})
            table.append([seqs, rows, f"{ms:.3f}"])
    for seqs in seqs_list:  # each further row against the first
        mine = {r["rows"]: r["ms"] for r in results if r["seqs"] == seqs}
        first, last = min(mine), max(mine)
        if last > first:
            extra = (mine[last] - mine[first]) / (last - first)
            first_ms = mine[first]
            print(f"{seqs} sequence(s): a further row {extra:.3f} ms a call, the first {first_ms:.3f}")
    print(format_table(["sequences", "rows each", "ms a call"], table))
    write_result(
        args.out,
        {"probe": "attention_rows", "args": vars(args), "results": results, "environment": environment()},
    )


if __name__ == "__main__":
    main()
