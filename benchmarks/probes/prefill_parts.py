"""Where a prefill chunk's time goes: the decoder stack over one chunk of a prompt (one C++ call)
against its 112 projections called alone on inputs of the chunk's shape, at the start of a prompt
and after a long context, so the difference shows what attention, norms, RoPE and the K/V writes
cost beside the matmuls, and how it grows with the context. The fastest of the rounds.

    .venv/bin/python benchmarks/probes/prefill_parts.py [--rows 512] [--starts 0,2048] [--out F.json]
"""

from __future__ import annotations

import argparse

import torch

from dynaspec.bench.common import decoder_projections, environment, format_table, median_ms, write_result
from dynaspec.engine.kv_cache import allocate_kv_cache, fill_kv_noise
from dynaspec.models.attention import build_attention_metadata
from dynaspec.models.build import effective_quantization
from dynaspec.models.loader import compute_dtypes, load_model, resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--rows", type=int, default=512, help="tokens in the chunk (the engine's default budget)")
    ap.add_argument("--starts", default="0,2048", help="the chunk's first position (context before it)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu, block = torch.device("cpu"), 16
    starts = [int(s) for s in args.starts.split(",") if s.strip()]
    source = resolve_model(args.model)
    dtype, kv_dtype = compute_dtypes("auto", effective_quantization("auto", source.is_gguf, cpu))
    model = load_model(source, "auto", dtype, cpu)
    slots = (max(starts) + args.rows + block) // block * block
    kv = allocate_kv_cache(model.config, slots, kv_dtype, cpu)
    fill_kv_noise(kv, torch.arange(slots))  # the context before each chunk, as real K/V would cost
    projections = decoder_projections(model)
    inputs = [torch.randn(args.rows, width) for _, width in projections]

    def projections_alone() -> None:
        for (p, _), x in zip(projections, inputs):
            p(x)

    def stack(start: int):
        end = start + args.rows
        meta = build_attention_metadata(
            [args.rows], [end], [list(range(slots // block))], block, cpu, rowwise=True
        )
        ids = torch.randint(100, 10_000, (args.rows,))
        positions = torch.arange(start, end)
        return lambda: model(ids, positions, kv, meta)

    parts = {f"stack, chunk at {s}": stack(s) for s in starts} | {"projections alone": projections_alone}
    best = dict.fromkeys(parts, float("inf"))
    for r in range(args.rounds):
        for name, fn in parts.items():
            best[name] = min(best[name], median_ms(fn, args.repeats, warmup=1))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.0f} ms" for k, v in best.items()), flush=True)
    alone = best["projections alone"]
    rows = [
        [
            name,
            f"{ms:.0f}",
            f"{args.rows / ms * 1e3:.0f}",
            f"{ms - alone:+.0f}" if name != "projections alone" else "",
        ]
        for name, ms in best.items()
    ]
    print(format_table(["part", "ms", "tokens/s", "beside the projections ms"], rows))
    write_result(
        args.out,
        {
            "probe": "prefill_parts",
            "args": vars(args),
            "best_ms": best,
            "environment": environment(),
        },
    )


if __name__ == "__main__":
    main()
