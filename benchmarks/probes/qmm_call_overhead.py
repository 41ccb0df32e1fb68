"""The quantized matmul's fixed cost per call (`git show e12b4e2:results/RESULTS.md`, "Where a drafter pass
goes"): one row through a Q8_0 layer small enough to stay in cache (32 x 896) and one the size of the
drafter's q projection (896 x 896), with 2 threads and with 1, through the `QuantLinear` module as the
model calls it.

    .venv/bin/python benchmarks/probes/qmm_call_overhead.py
"""

import argparse

import torch
from gguf import GGMLQuantizationType

from dynaspec.bench.common import ms_per_call
from dynaspec.models.gguf_blocks import decode_blocks, random_blocks
from dynaspec.models.qlinear import QuantLinear


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    qtype = GGMLQuantizationType.Q8_0
    for threads in (2, 1):
        torch.set_num_threads(threads)
        for shape in ((32, 896), (896, 896)):
            layer = QuantLinear(decode_blocks(random_blocks(qtype, shape, 0), qtype, shape), path="vnni")
            x = torch.randn(1, shape[1])
            with torch.inference_mode():
                us = ms_per_call(lambda layer=layer, x=x: layer(x), 2000) * 1000
            print(f"{threads} thread(s), Q8_0 {shape[0]} x {shape[1]}: {us:.1f} us a call")


if __name__ == "__main__":
    main()
