"""What a model's weights take in memory as the kernels hold them, per --quantization: the decoder layers'
bytes and bits per weight, and the LM head's (`git show e12b4e2:results/RESULTS.md`, "Where a tail step
goes"). A memory-bound pass streams these bytes, so two quantizations of equal bytes decode alike.

    .venv/bin/python benchmarks/probes/weight_bytes.py [--model qwen2.5-coder-0.5b-instruct]
        [--quantizations auto,int4] [--head-rows 32768]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from dynaspec.bench.common import format_table
from dynaspec.models.loader import load_model, resolve_model


def nbytes(module: nn.Module) -> int:
    tensors = list(module.buffers()) + list(module.parameters())
    return sum(t.numel() * t.element_size() for t in tensors)


def weights(module: nn.Module) -> int:
    return sum(m.in_features * m.out_features for m in module.modules() if hasattr(m, "out_features"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--quantizations", default="auto,int4")
    p.add_argument(
        "--head-rows", type=int, default=32768, help="LM head rows kept (0: all), as draft_vocab_size"
    )
    args = p.parse_args()
    source = resolve_model(args.model, progress=False)
    rows = []
    for quantization in args.quantizations.split(","):
        model = load_model(
            source, quantization, torch.float32, torch.device("cpu"), head_rows=args.head_rows or None
        )
        layers, head = model.model.layers, model.lm_head
        rows.append(
            [quantization, f"{nbytes(layers) / 1e6:.1f}", f"{8 * nbytes(layers) / weights(layers):.2f}"]
            + [f"{nbytes(head) / 1e6:.1f}", f"{8 * nbytes(head) / weights(head):.2f}"]
        )
    print(f"{args.model}, head cut to {args.head_rows or 'all'} rows")
    print(format_table(["quantization", "layers MB", "bits/weight", "head MB", "bits/weight"], rows))


if __name__ == "__main__":
    main()
