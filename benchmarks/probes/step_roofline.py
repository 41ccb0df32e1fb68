"""A plain batch-1 decode step against the memory's rate: the engine's step, the decoder stack's
forward, its projections called alone, the LM head alone, each with the bytes of weights it reads
and the GB/s that makes, beside a plain read of 1 GiB (issue 43's question: do the matmuls stream
at the memory's rate, and what does the step spend beside them). No llama.cpp here: `bench decode`
runs it side by side.

    .venv/bin/python benchmarks/probes/step_roofline.py [--model qwen2.5-coder-1.5b-instruct] \
        [--context 300] [--rounds 3] [--out F.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from dynaspec.bench.common import decoder_projections, median_ms
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.models.attention import build_attention_metadata
from dynaspec.sampling_params import SamplingParams


def nbytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.buffers()) + list(module.parameters()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--context", type=int, default=300, help="tokens the step's row attends to")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model=args.model, max_num_seqs=1, kv_cache_memory_gb=0.5, progress=False))
    model = engine.runner.model
    projections = [p for p, _ in decoder_projections(model)]
    inputs = [torch.randn(1, width) for _, width in decoder_projections(model)]
    layer_bytes = nbytes(model.model.layers)
    head_bytes = nbytes(model.lm_head)
    block = engine.allocator.block_size
    blocks = list(range(args.context // block + 1))
    meta = build_attention_metadata([1], [args.context], [blocks], block, torch.device("cpu"), rowwise=True)
    ids, positions = torch.tensor([1000]), torch.tensor([args.context - 1])
    hidden = torch.randn(1, engine.model_config.hidden_size)
    plain = torch.ones(2**28)  # 1 GiB, its pages touched

    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a quicksort in Python."}]
    )
    engine.add_request(prompt, SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True))
    for _ in range(5):
        engine.step()

    def projections_alone() -> None:
        for p, x in zip(projections, inputs):
            p(x)

    parts = {
        "engine step": (engine.step, layer_bytes + head_bytes),
        "decoder stack forward": (lambda: model(ids, positions, engine.runner.kv_caches, meta), layer_bytes),
        "its projections alone": (projections_alone, layer_bytes),
        "LM head alone": (lambda: model.compute_logits(hidden), head_bytes),
        "plain read of 1 GiB": (plain.sum, plain.numel() * 4),
    }
    rounds = []
    for r in range(args.rounds):
        row = {
            name: round(median_ms(fn, args.repeats if name != "plain read of 1 GiB" else 5), 2)
            for name, (fn, _) in parts.items()
        }
        rounds.append(row)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v} ms" for k, v in row.items()))
    best = {name: min(row[name] for row in rounds) for name in parts}
    print(f"\n{'part':24s} {'ms (best round)':>16s} {'MB read':>9s} {'GB/s':>6s}")
    table = []
    for name, (_, size) in parts.items():
        gbs = size / best[name] / 1e6
        table.append({"part": name, "ms": best[name], "mb": round(size / 1e6, 1), "gb_s": round(gbs, 1)})
        print(f"{name:24s} {best[name]:16.2f} {size / 1e6:9.1f} {gbs:6.1f}")
    rest = best["engine step"] - best["decoder stack forward"] - best["LM head alone"]
    print(f"the step beside the stack and the head: {rest:.2f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"args": vars(args), "rounds": rounds, "best": table, "rest_ms": round(rest, 2)}, f, indent=1
            )


if __name__ == "__main__":
    main()
