"""The quantized matmul streaming its weights from memory (`git show e12b4e2:results/RESULTS.md`, "The
kernel's one-row loop and prefetch"): rows through 12 distinct random layers of one GGUF block type, more
bytes than the L3 cache holds, so each call reads its weight from DRAM as in a model's forward pass
(`dynaspec bench qmatmul` repeats one layer, which stays in cache). Prints GB/s of weights and scales read,
and us per layer, then a plain read of 1 GiB (a float32 sum) for the memory's own rate.

    .venv/bin/python benchmarks/probes/qmm_stream.py [--format Q4_K] [--threads 2] [--rows 1] \
        [--shape 17920x1536]
"""

import argparse
import time

import torch
from gguf import GGMLQuantizationType

from dynaspec.models.gguf_blocks import decode_blocks, random_blocks
from dynaspec.models.qlinear import QuantLinear


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", default="Q4_K")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--shape", default="17920x1536", help="out x in of each layer (the 1.5B's gate/up)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    qtype = GGMLQuantizationType[args.format]
    shape = tuple(int(v) for v in args.shape.split("x"))
    layers = [
        QuantLinear(decode_blocks(random_blocks(qtype, shape, seed), qtype, shape), path="vnni")
        for seed in range(args.layers)
    ]
    nbytes = sum(b.numel() * b.element_size() for layer in layers for b in layer.buffers())
    x = torch.randn(args.rows, shape[1])
    times = []
    with torch.inference_mode():
        for i in range(args.repeats + 3):
            start = time.perf_counter()
            for layer in layers:
                layer(x)
            if i >= 3:  # warm-up passes
                times.append(time.perf_counter() - start)
    dt = sorted(times)[len(times) // 2]
    ones = torch.ones(2**28)
    read = [_seconds(ones.sum) for _ in range(5)][1:]
    print(
        f"{args.format} rows={args.rows} threads={args.threads}: {nbytes / 1e6:.0f} MB in {dt * 1e3:.2f} ms, "
        f"{nbytes / dt / 1e9:.1f} GB/s, {dt * 1e6 / args.layers:.0f} us per layer; "
        f"a plain read of 1 GiB: {ones.numel() * 4 / sorted(read)[len(read) // 2] / 1e9:.1f} GB/s"
    )


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
