"""`dynaspec generate`: run prompts concurrently through the engine and print the completions."""

from __future__ import annotations

import argparse
import json
import sys
import time

from dynaspec.datasets import load_prompts
from dynaspec.engine.args import add_engine_args, engine_kwargs
from dynaspec.sampling_params import SamplingParams


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts")
    add_engine_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    src.add_argument(
        "--prompts-file",
        help="JSONL (prompt or messages field), JSON list, text lines, or a built-in set: mtbench, "
        "humaneval, codeedit (edit a whole HumanEval function), longedit (the same after a 2,000-token "
        "module), mixed, gsm8k (math, training split)",
    )
    p.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--request-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt, then a summary line")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dynaspec.llm import LLM

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.request_seed,
        stop=args.stop,
    )
    if args.prompt:
        prompts = [[{"role": "user", "content": t}] if args.chat else t for t in args.prompt]
    else:
        prompts = load_prompts(args.prompts_file, chat=args.chat)
    if args.num_prompts is not None:
        prompts = prompts[: args.num_prompts]
    llm = LLM(args.model, **engine_kwargs(args))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, progress=not args.json and sys.stderr.isatty())
    wall = time.perf_counter() - start
    n_out = sum(len(o.token_ids) for o in outputs)
    stats = llm.stats()
    summary = {
        "num_prompts": len(outputs),
        "wall_time_s": round(wall, 3),
        "output_tokens": n_out,
        "output_tokens_per_s": round(n_out / wall, 3) if wall > 0 else 0.0,
        **stats,
    }
    if args.json:
        for i, o in enumerate(outputs):
            print(
                json.dumps(
                    {
                        "index": i,
                        "text": o.text,
                        "token_ids": o.token_ids,
                        "num_output_tokens": len(o.token_ids),
                        "num_prompt_tokens": len(o.prompt_token_ids),
                        "finish_reason": o.finish_reason,
                    }
                )
            )
        print(json.dumps({"summary": summary}))
        return 0
    for i, o in enumerate(outputs):
        print(f"--- [{i}] {len(o.token_ids)} tokens, finish: {o.finish_reason}")
        print(o.text)
    print(
        f"--- {len(outputs)} prompts, {n_out} tokens in {wall:.2f} s: "
        f"{summary['output_tokens_per_s']:.2f} tokens/s"
    )
    if "spec" in stats:
        print(format_spec_stats(stats["spec"]))
    return 0


def format_spec_stats(spec: dict) -> str:
    lines = [
        f"speculation: acceptance length {spec['acceptance_length']:.2f}, "
        f"acceptance rate {spec['acceptance_rate']:.2f}, "
        f"{spec['num_accepted_tokens']}/{spec['num_draft_tokens']} draft tokens accepted",
        "acceptance per position: " + " ".join(f"{a:.2f}" for a in spec["acceptance_rate_per_pos"]),
        "steps at each K by decode batch size (K adapting to load):",
    ]
    for bs, per_k in spec["steps_by_batch_size"].items():
        lines.append(f"  bs {bs:>3}: " + ", ".join(f"K={k}: {n}" for k, n in per_k.items()))
    return "\n".join(lines)
