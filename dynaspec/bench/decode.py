"""`dynaspec bench decode`: plain greedy decode tokens/s per batch size, dynaspec next to reference
engines on the same model file: llama.cpp (llama-cpp-python, its batch API with one sequence id per
request, the way its server runs parallel slots) and transformers `generate`.

Same prompts (chat template, or with --context N, N tokens of the dataset's text each) and output
length for every engine. Decode speed excludes prefill: each batch is run for N new tokens, t_1
being when every request had its first (the batch's time to first token) and t_N the end, and
decode tokens/s = batch x (N - 1) / (t_N - t_1). dynaspec and llama.cpp tell t_1 from within the
run; transformers `generate` cannot, so its t_1 is a second run's, for 1 token. Engines take turns
on every batch.
"""

from __future__ import annotations

import argparse
import time

from dynaspec.bench.common import command_args, format_table, write_result
from dynaspec.engine.args import add_load_format_arg


def add_parser(sub) -> None:
    p = sub.add_parser("decode", help="greedy decode tok/s per batch size, dynaspec vs reference engines")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--context",
        type=int,
        default=0,
        help="prompts of this many tokens of the dataset's text (a long context) instead of chat prompts",
    )
    p.add_argument("--repeats", type=int, default=1, help="batches per batch size (different prompts)")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"])
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    add_load_format_arg(p)
    p.add_argument(
        "--engines",
        default="dynaspec,llama.cpp",
        help="comma-separated, of dynaspec, llama.cpp (same GGUF, llama-cpp-python), transformers",
    )
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: torch's)")
    p.add_argument(
        "--result-file",
        default="bench-results/decode.json",
        help="JSON path (default %(default)s: out of the record under results/)",
    )
    p.set_defaults(func=run)


ENGINES = ("dynaspec", "llama.cpp", "transformers")


def run(args: argparse.Namespace) -> int:
    import torch

    from dynaspec.bench import llamacpp
    from dynaspec.datasets import load_prompts
    from dynaspec.engine.engine import Engine, EngineConfig
    from dynaspec.models.loader import resolve_model
    from dynaspec.sampling_params import SamplingParams

    sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if not sizes or min(sizes) < 1:
        raise ValueError("--batch-sizes: need comma-separated integers >= 1")
    names = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in names if e not in ENGINES]
    if args.context < 0:
        raise ValueError(f"--context: must be >= 0, got {args.context}")
    if unknown or not names or names[0] != "dynaspec":
        raise ValueError(
            f"--engines: dynaspec first, then any of {', '.join(ENGINES[1:])}; got {args.engines!r}"
        )
    if args.load_format == "dummy" and names != ["dynaspec"]:
        raise ValueError("--load-format dummy: --engines dynaspec only (the references read the weights)")
    engine = Engine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            load_format=args.load_format,
            max_num_seqs=max(sizes),
            enable_prefix_caching=False,  # repeats send the same prompts: each must prefill afresh
            # 64 KB a token of context: twice the 1.5B's K/V, room for a larger model's
            kv_cache_memory_gb=1.0 + max(sizes) * (args.context + args.max_tokens) * 64e3 / 1e9,
        )
    )
    source = resolve_model(args.model, load_format=args.load_format)
    prompts = load_prompts(args.dataset, chat=True)
    text_ids = (
        engine.tokenizer.encode("\n".join(load_prompts(args.dataset, chat=False))) if args.context else []
    )
    if args.context > len(text_ids) // 2:
        raise ValueError(
            f"--context: {args.dataset}'s text has {len(text_ids)} tokens, too few for {args.context}"
        )

    def prompt(i: int) -> list[int]:
        """Request i's prompt: a chat prompt, or ``--context`` tokens of text from an offset of its own."""
        if not args.context:
            return engine.tokenizer.apply_chat_template(prompts[i % len(prompts)])
        start = i * 997 % (len(text_ids) - args.context)
        return text_ids[start : start + args.context]

    pad_id = engine.tokenizer.eos_token_ids[0]

    def dynaspec_run(batch: list[list[int]], n: int) -> tuple[float, list[list[int]], float]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        requests = [engine.add_request(ids, params) for ids in batch]
        first = None
        while engine.has_unfinished():
            engine.step()
            if first is None and all(r.output_token_ids for r in requests):
                first = time.perf_counter() - start
        return time.perf_counter() - start, [r.output_token_ids for r in requests], first

    runners = {"dynaspec": dynaspec_run}
    if "llama.cpp" in names:
        gguf = llamacpp.reference_file(args.model)
        if gguf is not None:
            threads = args.threads or torch.get_num_threads()
            n_ctx = max(4096, max(sizes) * (args.context + args.max_tokens + 64))
            lc = llamacpp.LlamaCppBatch(gguf, threads, max(sizes), n_ctx=n_ctx)
            runners["llama.cpp"] = lc.generate
    if "transformers" in names:
        from transformers import AutoModelForCausalLM

        dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
        hf = AutoModelForCausalLM.from_pretrained(**source.transformers_kwargs(), dtype=dtype).eval()

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
            return time.perf_counter() - start, out[:, width:].tolist(), None

        runners["transformers"] = hf_run

    records, rows = [], []
    cursor = 0
    warm = [engine.tokenizer.encode("warm up")]
    for fn in runners.values():
        fn(warm, 2)  # first-call allocations
    for bs in sizes:
        acc = {
            name: {"decode_s": 0.0, "tokens": 0, "e2e_s": 0.0, "first_s": 0.0, "outputs": []}
            for name in runners
        }
        for _ in range(args.repeats):
            batch = [prompt(cursor + i) for i in range(bs)]
            cursor += bs
            for name, fn in runners.items():  # interleaved: every engine on the same batch in turn
                tn, outs, t1 = fn(batch, args.max_tokens)
                if t1 is None:  # an engine that cannot tell when its first tokens came: a run for one
                    t1 = fn(batch, 1)[0]
                a = acc[name]
                a["decode_s"] += max(tn - t1, 1e-9)
                a["tokens"] += bs * (args.max_tokens - 1)
                a["e2e_s"] += tn
                a["first_s"] += t1
                a["outputs"] += outs
        speeds = {name: a["tokens"] / a["decode_s"] for name, a in acc.items()}
        ours = acc["dynaspec"]["outputs"]
        agree = {
            name: sum(_common_prefix(x, y) for x, y in zip(ours, a["outputs"]))
            for name, a in acc.items()
            if name != "dynaspec"
        }
        total = len(ours) * args.max_tokens
        row = [bs, speeds["dynaspec"]]
        for name in list(runners)[1:]:
            row += [speeds[name], speeds["dynaspec"] / speeds[name], f"{agree[name]}/{total}"]
        rows.append(row)
        record = {"batch_size": bs}
        for name, a in acc.items():
            key = name.replace(".", "")
            record[f"{key}_decode_tokens_per_s"] = round(speeds[name], 3)
            record[f"{key}_first_token_s"] = round(a["first_s"] / args.repeats, 4)
            record[f"{key}_e2e_s"] = round(a["e2e_s"], 3)
            if name != "dynaspec":
                record[f"dynaspec_over_{key}"] = round(speeds["dynaspec"] / speeds[name], 3)
        record["greedy_tokens_agreeing_prefix"] = {k.replace(".", ""): v for k, v in agree.items()}
        record["greedy_tokens_total"] = total
        records.append(record)
        print(f"batch size {bs} done", flush=True)
    headers = ["batch", "dynaspec tok/s"]
    for name in list(runners)[1:]:
        headers += [f"{name} tok/s", f"dynaspec / {name}", "greedy prefix agree"]
    print(format_table(headers, rows))
    write_result(
        args.result_file,
        {
            "benchmark": "decode",
            "args": command_args(args),
            "quantization": engine.quantization,
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
