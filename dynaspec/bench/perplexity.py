"""`dynaspec bench perplexity`: the quality cost of each weight form, against llama.cpp on the same file.

A fixed text (the bundled HumanEval prompts, then the MT-Bench questions, concatenated) is cut into
chunks of `--ctx` tokens; as llama.cpp's perplexity tool does, each chunk is one forward pass and
only the second half of its positions is scored (every scored token sees at least ctx/2 tokens of
context). Configurations, side by side on the same tokens: dynaspec with the GGUF's own quantized
blocks (the default), dynaspec with the weights dequantized to dense bfloat16 (`--quantization
none`), and llama.cpp's own evaluation of the file (llama-cpp-python, when installed).
"""

from __future__ import annotations

import argparse
import math

from dynaspec.bench.common import command_args, format_table, write_result


def add_parser(sub) -> None:
    p = sub.add_parser("perplexity", help="perplexity per weight form, and llama.cpp's, on a fixed text")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (the second half is scored)")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--configs", default="auto,none", help="dynaspec --quantization values to evaluate")
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument(
        "--result-file",
        default="bench-results/perplexity.json",
        help="JSON path (default %(default)s: out of the record under results/)",
    )
    p.set_defaults(func=run)


def fixed_text() -> str:
    from dynaspec.datasets import load_prompts

    parts = []
    for dataset in ("humaneval", "mt_bench"):
        for prompt in load_prompts(dataset, chat=False):
            parts.append(prompt if isinstance(prompt, str) else str(prompt))
    return "\n\n".join(parts)


def _nll(logits, ids: list[int], start: int) -> tuple[float, int]:
    """Summed negative log-likelihood of ids[start+1:] given logits rows start.. (float64 sums)."""
    import torch

    rows = torch.as_tensor(logits[start : len(ids) - 1]).double()
    targets = torch.tensor(ids[start + 1 :])
    logp = torch.log_softmax(rows, dim=-1).gather(1, targets[:, None])
    return float(-logp.sum()), len(targets)


def run(args: argparse.Namespace) -> int:
    import torch

    from dynaspec.bench import llamacpp
    from dynaspec.engine.engine import Engine, EngineConfig
    from dynaspec.engine.runner import TokenRun
    from dynaspec.models.loader import resolve_model

    source = resolve_model(args.model)
    tokenizer = source.tokenizer()
    ids = tokenizer.encode(fixed_text())
    chunks = [ids[i * args.ctx : (i + 1) * args.ctx] for i in range(len(ids) // args.ctx)][: args.chunks]
    if not chunks:
        raise ValueError(f"--ctx: the text has only {len(ids)} tokens")
    half = args.ctx // 2
    results: dict[str, float] = {}
    for quantization in [c.strip() for c in args.configs.split(",") if c.strip()]:
        engine = Engine(
            EngineConfig(
                model=args.model, quantization=quantization, kv_cache_memory_gb=0.25, max_model_len=args.ctx
            )
        )
        nll, count = 0.0, 0
        for chunk in chunks:
            blocks: list[int] = []
            if not engine.allocator.grow(blocks, len(chunk)):
                raise RuntimeError("KV budget too small for one chunk")
            try:
                logits = engine.runner.run([TokenRun(chunk, 0, blocks, list(range(len(chunk))))])
            finally:
                engine.allocator.free(blocks)
            a, b = _nll(logits, chunk, half - 1)
            nll, count = nll + a, count + b
        name = f"dynaspec {engine.quantization}" + (f" ({engine.dtype})".replace("torch.", ""))
        results[name] = math.exp(nll / count)
        print(f"{name}: perplexity {results[name]:.4f} over {count} tokens", flush=True)
        del engine
    gguf = None if args.no_llamacpp else llamacpp.reference_file(args.model)
    if gguf is not None:
        lc = llamacpp.LlamaCppBatch(gguf, torch.get_num_threads(), 1, n_ctx=args.ctx + 16)
        nll, count = 0.0, 0
        for chunk in chunks:
            a, b = _nll(lc.logits(chunk), chunk, half - 1)
            nll, count = nll + a, count + b
        lc.close()
        results["llama.cpp"] = math.exp(nll / count)
        print(f"llama.cpp: perplexity {results['llama.cpp']:.4f}", flush=True)
    ref = results.get("llama.cpp")
    rows = [[name, ppl, None if ref is None else ppl / ref - 1] for name, ppl in results.items()]
    print(format_table(["config", "perplexity", "vs llama.cpp"], rows))
    write_result(
        args.result_file,
        {
            "benchmark": "perplexity",
            "args": command_args(args),
            "scored_tokens": len(chunks) * (args.ctx - half),
            "rows": [
                {
                    "config": n,
                    "perplexity": round(p, 5),
                    "relative_to_llamacpp": None if ref is None else round(p / ref - 1, 5),
                }
                for n, p in results.items()
            ],
        },
    )
    return 0
