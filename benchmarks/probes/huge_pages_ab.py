"""Weights in 2 MiB pages against 4 KiB pages, in one process (`dynaspec.models.hugepages`): the
target's (and a drafter's) weights are copied into two mappings of the same layout, one advised for
huge pages and one against them, and the engine's decode steps run on one, then the other, in short
alternating blocks (the tensors are pointed from one copy to the other between blocks, which costs
no copy). The VM's drift between processes, and most of it within one, cancels in each pair of
blocks. Prints the median of the per-pair ratios and each variant's median tok/s; JSON with --out.

With --stream, quantized matmuls alone instead: ``--layers`` random layers of one block type
(more bytes than the L3 cache holds, so each call streams its weight from memory), in three
placements visited in rotating order: where PyTorch's allocator put them, the same layout in 4 KiB
pages and in 2 MiB pages. Prints ms per pass over the layers and the per-round ratios to the first.

    .venv/bin/python benchmarks/probes/huge_pages_ab.py [--batch-sizes 1,8] [--pairs 20] [--block 8] \
        [--speculative-config '{"method": "draft_model", ...}'] [--out results/.../huge_pages_ab.json]
    .venv/bin/python benchmarks/probes/huge_pages_ab.py --stream [--format Q4_K] [--shape 17920x1536] \
        [--rows 1] [--layers 24] [--pairs 60]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch
from gguf import GGMLQuantizationType
from torch import nn

from dynaspec import SamplingParams
from dynaspec.bench.common import ms_per_call
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.models.gguf_blocks import decode_blocks, random_blocks
from dynaspec.models.hugepages import MIN_BYTES, place_on_huge_pages
from dynaspec.models.qlinear import QuantLinear


def _copies(owners: list[nn.Module], device: torch.device) -> tuple[list, dict[bool, list]]:
    """The moved tensors and, for 4 KiB (False) and 2 MiB (True) pages, where each one's copy is
    (storage, offset) and the placements holding the two mappings."""
    where: dict[bool, list] = {}
    for huge in (False, True):
        placements = [place_on_huge_pages([m], device, huge=huge) for m in owners]
        tensors = [t for m in owners for t in [*m.parameters(), *m.buffers()] if t.nbytes >= MIN_BYTES]
        where[huge] = [placements, [(t.untyped_storage(), t.storage_offset()) for t in tensors]]
    return tensors, where


def _point(tensors: list[torch.Tensor], copies: list) -> None:
    with torch.no_grad():
        for t, (storage, offset) in zip(tensors, copies):
            t.set_(storage, offset, t.size(), t.stride())


def stream(args) -> dict:
    """The --stream mode (see the module docstring)."""
    qtype = GGMLQuantizationType[args.format]
    n_out, n_in = (int(v) for v in args.shape.split("x"))
    layers = [
        QuantLinear(decode_blocks(random_blocks(qtype, (n_out, n_in), s), qtype, (n_out, n_in)), path="vnni")
        for s in range(args.layers)
    ]
    tensors = [t for m in layers for t in m.buffers() if t.nbytes >= MIN_BYTES]
    where = {"allocator": [(t.untyped_storage(), t.storage_offset()) for t in tensors]}
    keep = []  # the placements hold their mappings
    for name, huge in (("4 KiB", False), ("2 MiB", True)):
        keep.append(place_on_huge_pages(layers, torch.device("cpu"), huge=huge))
        where[name] = [(t.untyped_storage(), t.storage_offset()) for t in tensors]
    x = torch.randn(args.rows, n_in)
    ms: dict[str, list[float]] = {name: [] for name in where}
    orders = list(itertools.permutations(where))
    with torch.inference_mode():
        for round_ in range(args.pairs):
            for name in orders[round_ % len(orders)]:
                _point(tensors, where[name])
                for layer in layers:  # once untimed: the copy's pages in the TLB's and caches' state
                    layer(x)
                start = time.perf_counter()
                for layer in layers:
                    layer(x)
                ms[name].append((time.perf_counter() - start) * 1e3)
    out = {"huge_bytes": keep[1].huge_bytes, "mb": round(sum(t.nbytes for t in tensors) / 1e6, 1)}
    for name, values in ms.items():
        ratios = [a / b for a, b in zip(ms["allocator"], values)]
        out[name] = {
            "ms_median": round(statistics.median(values), 3),
            "allocator_over_this": round(statistics.median(ratios), 3),
            "quartiles": [round(q, 3) for q in statistics.quantiles(ratios, n=4)],
        }
        print(
            f"{args.format} {args.shape} rows {args.rows} x {args.layers} ({out['mb']} MB): {name:9s} "
            f"{out[name]['ms_median']:.2f} ms; allocator / this per round: median "
            f"{out[name]['allocator_over_this']}, quartiles {out[name]['quartiles']}",
            flush=True,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--speculative-config", default=None, help="JSON; its drafter's weights move too")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--pairs", type=int, default=20, help="pairs of blocks per batch size")
    ap.add_argument("--block", type=int, default=8, help="engine steps timed per block")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--stream", action="store_true", help="quantized matmuls alone (module docstring)")
    ap.add_argument("--format", default="Q4_K")
    ap.add_argument("--shape", default="17920x1536", help="out x in (the 1.5B's gate/up)")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.stream:
        summary = stream(args)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "summary": summary}, f, indent=1)
        return
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    engine = Engine(
        EngineConfig(model=args.model, speculative_config=spec, kv_cache_memory_gb=0.5, progress=False)
    )
    owners = [engine.runner.model] + [v for v in vars(engine.proposer).values() if isinstance(v, nn.Module)]
    tensors, where = _copies(owners, engine.device)
    huge_bytes = sum(p.huge_bytes or 0 for p in where[True][0] if p is not None)
    small_bytes = sum(p.huge_bytes or 0 for p in where[False][0] if p is not None)
    print(
        f"{len(tensors)} tensors; resident in huge pages: 2 MiB copy {huge_bytes / 1e9:.2f} GB, "
        f"4 KiB copy {small_bytes / 1e9:.2f} GB"
    )
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Write a quicksort in Python."}])
    params = SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True)
    summary = {}
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        requests = [engine.add_request(ids, params) for _ in range(bs)]
        while not all(r.is_decoding for r in requests):
            engine.step()
        for _ in range(5):
            engine.step()
        rates: dict[bool, list[float]] = {False: [], True: []}
        for pair in range(args.pairs):
            for huge in (False, True) if pair % 2 == 0 else (True, False):
                _point(tensors, where[huge][1])
                engine.step()  # one step on the new copy before the clock
                rates[huge].append(bs * 1000 / ms_per_call(engine.step, args.block))
        ratios = [h / s for h, s in zip(rates[True], rates[False])]
        summary[f"bs{bs}"] = {
            "4KiB_tok_s": round(statistics.median(rates[False]), 2),
            "2MiB_tok_s": round(statistics.median(rates[True]), 2),
            "ratio_median": round(statistics.median(ratios), 3),
            "ratio_quartiles": [round(q, 3) for q in statistics.quantiles(ratios, n=4)],
            "pairs": [[round(s, 2), round(h, 2)] for s, h in zip(rates[False], rates[True])],
        }
        row = summary[f"bs{bs}"]
        print(
            f"batch {bs}: 4 KiB {row['4KiB_tok_s']} tok/s, 2 MiB {row['2MiB_tok_s']} tok/s; "
            f"2 MiB / 4 KiB per pair: median {row['ratio_median']}, quartiles {row['ratio_quartiles']}",
            flush=True,
        )
        for r in requests:
            engine.abort(r.request_id)
        while engine.has_unfinished():
            engine.step()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"args": vars(args), "tensors": len(tensors), "huge_bytes": huge_bytes, "summary": summary},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
