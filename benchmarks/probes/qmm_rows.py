"""Milliseconds per quantized linear forward against rows, for the C++ operator as built from the
``dynaspec`` package on the path; ``kernel_ab.py --rows "<these arguments>"`` runs it against a
revision's kernels, alternating (the results record's run used two checkouts on PYTHONPATH instead).
The VNNI loop alone (``--no-amx``) stands for a CPU without AMX.

    .venv/bin/python benchmarks/probes/qmm_rows.py --shapes gate_up,down --rows 1,2,3,4,8,16 [--no-amx]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from gguf import GGMLQuantizationType

import dynaspec
from dynaspec.bench.qmatmul import SHAPES
from dynaspec.models.gguf_blocks import decode_blocks, random_blocks
from dynaspec.models.qlinear import NO_AMX, QuantLinear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--rows", default="1,2,3,4,8,16")
    ap.add_argument("--format", default="Q4_K")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-amx", action="store_true")
    ap.add_argument("--out", help="JSON path")
    args = ap.parse_args()
    torch.set_num_threads(2)
    qtype = GGMLQuantizationType[args.format]
    rows_list = [int(r) for r in args.rows.split(",")]
    result = {"package": dynaspec.__file__, "no_amx": args.no_amx, "ms": {}}
    for shape in args.shapes.split(","):
        n_out, n_in = SHAPES[shape]
        raw = random_blocks(qtype, (n_out, n_in), 0)
        layer = QuantLinear(decode_blocks(raw, qtype, (n_out, n_in)), path="vnni", dtype=torch.bfloat16)
        if args.no_amx:
            layer.impl.amx_min_rows = NO_AMX
        for rows in rows_list:
            x = torch.randn(rows, n_in).bfloat16()
            with torch.inference_mode():
                for _ in range(3):
                    layer(x)
                start = time.perf_counter()
                calls = 0
                while time.perf_counter() - start < 0.05:
                    layer(x)
                    calls += 1
                samples = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    for _ in range(calls):
                        layer(x)
                    samples.append((time.perf_counter() - start) * 1e3 / calls)
            result["ms"][f"{shape}/{rows}"] = round(statistics.median(samples), 4)
    print(json.dumps(result["ms"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
