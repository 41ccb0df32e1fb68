"""Host costs around a batch-1 step that are not the model's layers: the greedy argmax and a
draft's top probability over a vocabulary (torch's ops against `greedy_tokens` and
`top_probability`), a layer's K/V write into the cache (`.to` and two `index_copy_` against
`kv_write_`), and the GGUF token embedding's row lookups (the decode of a row that is not
kept, and how many decode-sized lookups the kept rows answer over MT-Bench requests).

    .venv/bin/python benchmarks/probes/host_costs.py [--requests 12] [--max-tokens 128] [--out F.json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from dynaspec.bench.common import median_ms
from dynaspec.datasets import load_prompts
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.engine.sampler import greedy_tokens, top_probability
from dynaspec.models.build import QuantEmbedding
from dynaspec.sampling_params import SamplingParams


def median_us(fn, calls: int = 2000) -> float:
    return round(median_ms(fn, calls, warmup=50) * 1000, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--requests", type=int, default=12, help="MT-Bench requests decoded one at a time")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out: dict = {"vocab": {}}
    print("over the vocabulary, us a call (median):")
    for vocab in (16384, 151936):
        for rows in (1, 2):
            x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 4
            row = {
                "torch argmax": median_us(lambda x=x: x.argmax(-1)),
                "greedy_tokens": median_us(lambda x=x: greedy_tokens(x)),
                "softmax + max": median_us(lambda x=x: torch.softmax(x, -1).max(-1)),
                "top_probability": median_us(lambda x=x: top_probability(x)),
            }
            out["vocab"][f"{vocab}x{rows}"] = row
            print(f"  vocab {vocab:6d}, {rows} row(s): " + ", ".join(f"{k} {v}" for k, v in row.items()))

    engine = Engine(EngineConfig(model=args.model, max_num_seqs=1, kv_cache_memory_gb=1.0, progress=False))
    cfg = engine.model_config
    kv = cfg.num_key_value_heads * cfg.head_dim
    k_cache = torch.zeros(8192, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(1, cfg.num_attention_heads * cfg.head_dim + 2 * kv)  # one decode row's projection
    k = qkv[:, -2 * kv : -kv].reshape(1, cfg.num_key_value_heads, cfg.head_dim).contiguous()
    v = qkv[:, -kv:].reshape(1, cfg.num_key_value_heads, cfg.head_dim)
    slot = torch.tensor([4321])

    def aten_write():
        k_cache.index_copy_(0, slot, k.to(k_cache.dtype))
        v_cache.index_copy_(0, slot, v.to(v_cache.dtype))

    out["kv_write_us_a_layer"] = {
        "to + index_copy_": median_us(aten_write),
        "kv_write_": median_us(lambda: torch.ops.dynaspec.kv_write_(k_cache, v_cache, k, v, slot)),
    }
    print("a layer's K/V write, one row, us (from Python): " + str(out["kv_write_us_a_layer"]))
    embed = engine.runner.model.model.embed_tokens
    if not isinstance(embed, QuantEmbedding):
        raise SystemExit(f"{args.model}: its embedding is not looked up from GGUF rows")
    one = np.array([1000])
    out["embedding_row_decode_us"] = median_us(lambda: embed._decode(one), 200)
    counts = {"lookups": 0, "decodes": 0}
    decode, forward = embed._decode, embed.forward

    def counted_decode(ids):
        counts["decodes"] += 1
        return decode(ids)

    def counted_forward(ids):
        counts["lookups"] += len(ids) <= QuantEmbedding.CACHE_LOOKUP_ROWS
        return forward(ids)

    embed._decode, embed.forward = counted_decode, counted_forward
    out["requests"] = []
    prompts = load_prompts("mtbench", chat=True)[: args.requests]
    for i, prompt in enumerate(prompts):
        before = dict(counts)
        ids = engine.tokenizer.apply_chat_template(prompt)
        engine.add_request(ids, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
        prefill_decode = len(ids) > QuantEmbedding.CACHE_LOOKUP_ROWS  # decoded directly, not counted
        lookups = counts["lookups"] - before["lookups"]
        misses = counts["decodes"] - before["decodes"] - prefill_decode
        entry = {"lookups": lookups, "kept": lookups - misses, "rows_kept": len(embed.cache)}
        out["requests"].append(entry)
        print(
            f"request {i}: {lookups} decode-sized lookups, {lookups - misses} answered by kept rows "
            f"({(lookups - misses) / max(lookups, 1):.2f}), {len(embed.cache)} rows kept"
        )
    print(f"one row's decode: {out['embedding_row_decode_us']} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
