"""`dynaspec bench decode`: plain decode tokens/s, dynaspec next to transformers `generate`.

Same model directory, prompts (chat template), dtype and output length for both. Decode speed
excludes prefill the same way for both: each batch is run for N new tokens and for 1 new token,
and decode tokens/s = batch x (N - 1) / (t_N - t_1). Runs alternate between the two engines.
"""

from __future__ import annotations

import argparse
import time

from dynaspec.bench.common import format_table, write_result


def add_parser(sub) -> None:
    p = sub.add_parser("decode", help="plain decode tokens/s: dynaspec vs transformers generate")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="batches per batch size (different prompts)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--no-hf", action="store_true", help="dynaspec only")
    p.add_argument("--result-file", default="results/bench_decode.json")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from dynaspec.datasets import load_prompts
    from dynaspec.engine.engine import Engine, EngineConfig
    from dynaspec.models.loader import resolve_model
    from dynaspec.sampling_params import SamplingParams

    sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if not sizes or min(sizes) < 1:
        raise ValueError("--batch-sizes: need comma-separated integers >= 1")
    engine = Engine(
        EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=max(sizes), kv_cache_memory_gb=1.0)
    )
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
        hf = AutoModelForCausalLM.from_pretrained(
            **resolve_model(args.model).transformers_kwargs(), dtype=dtype
        ).eval()
    prompts = load_prompts(args.dataset, chat=True)
    pad_id = engine.tokenizer.eos_token_ids[0]

    def dynaspec_run(batch: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        requests = [engine.add_request(ids, params) for ids in batch]
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - start, [r.output_token_ids for r in requests]

    def hf_run(batch: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
        width = max(len(ids) for ids in batch)
        x = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(
                x,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=pad_id,
            )
        return time.perf_counter() - start, out[:, width:].tolist()

    runners = {"dynaspec": dynaspec_run}
    if hf is not None:
        runners["transformers"] = hf_run
    records, rows = [], []
    cursor = 0
    dynaspec_run([engine.tokenizer.encode("warm up")], 2)  # first-call allocations
    for bs in sizes:
        acc = {name: {"decode_s": 0.0, "tokens": 0, "e2e_s": 0.0, "outputs": []} for name in runners}
        for _ in range(args.repeats):
            batch = [
                engine.tokenizer.apply_chat_template(prompts[(cursor + i) % len(prompts)]) for i in range(bs)
            ]
            cursor += bs
            for name, fn in runners.items():
                t1, _ = fn(batch, 1)
                tn, outs = fn(batch, args.max_tokens)
                a = acc[name]
                a["decode_s"] += max(tn - t1, 1e-9)
                a["tokens"] += bs * (args.max_tokens - 1)
                a["e2e_s"] += tn
                a["outputs"] += outs
        speeds = {name: a["tokens"] / a["decode_s"] for name, a in acc.items()}
        agree = None
        if "transformers" in acc:
            agree = sum(
                _common_prefix(x, y)
                for x, y in zip(acc["dynaspec"]["outputs"], acc["transformers"]["outputs"])
            )
        ratio = speeds["dynaspec"] / speeds["transformers"] if "transformers" in speeds else None
        rows.append(
            [
                bs,
                speeds["dynaspec"],
                speeds.get("transformers"),
                ratio,
                None if agree is None else f"{agree}/{len(acc['dynaspec']['outputs']) * args.max_tokens}",
            ]
        )
        records.append(
            {
                "batch_size": bs,
                "dynaspec_decode_tokens_per_s": round(speeds["dynaspec"], 3),
                "transformers_decode_tokens_per_s": round(speeds["transformers"], 3)
                if "transformers" in speeds
                else None,
                "ratio": None if ratio is None else round(ratio, 3),
                "dynaspec_e2e_s": round(acc["dynaspec"]["e2e_s"], 3),
                "transformers_e2e_s": round(acc["transformers"]["e2e_s"], 3)
                if "transformers" in acc
                else None,
                "greedy_tokens_agreeing_prefix": agree,
            }
        )
        print(f"batch size {bs} done", flush=True)
    print(
        format_table(["batch", "dynaspec tok/s", "transformers tok/s", "ratio", "greedy prefix agree"], rows)
    )
    write_result(
        args.result_file,
        {
            "benchmark": "decode",
            "args": {k: v for k, v in vars(args).items() if k != "func"},
            "rows": records,
        },
    )
    return 0


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
