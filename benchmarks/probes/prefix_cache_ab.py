"""Prefix caching on and off, side by side in one process: two engines of the target, one with
the cache and one without, run the same workloads in alternating order (ABBA rounds); the on
engine starts each run with its cache empty. Every output must be the same on both (the
kernels are batch invariant, so a cached block holds the bits a fresh prefill would compute).

Workloads:
- grpo: ``--grpo-prompts`` GSM8K training prompts x ``--samples`` samples sent at once
  (temperature 1.0, each sample its own seed): the makespan and the mean time to first token;
- turns: ``--turns`` MT-Bench questions one after another, each asked, answered, then followed by
  its second turn (the conversation sent back): the second turn's time to first token;
- document: one text of ``--doc-tokens`` tokens (HumanEval's prompts) and ``--questions``
  questions after it, asked one at a time: the time to first token of each.

    .venv/bin/python benchmarks/probes/prefix_cache_ab.py [--rounds 2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from dynaspec import SamplingParams
from dynaspec.bench.common import environment, format_table, write_result
from dynaspec.datasets import BUILTIN, load_prompts
from dynaspec.engine.engine import Engine, EngineConfig

QUESTIONS = [
    "Which of these functions sorts a list?",
    "Name two functions above that parse strings.",
    "Which function is the shortest?",
    "Do any of the functions above use recursion?",
    "Which function would you test first, and why?",
    "List the functions that return a boolean.",
    "Which function has the longest docstring?",
    "Suggest a better name for the first function.",
]


def drain(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def ttft_ms(request) -> float:
    return (request.first_token_time - request.arrival_time) * 1e3


def run_grpo(engine: Engine, args, rnd: int) -> dict:
    prompts = load_prompts("gsm8k", chat=True)[: args.grpo_prompts]
    start = time.perf_counter()
    requests = [
        engine.add_request(
            p,
            SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=rnd * 1000 + i * 16 + s),
        )
        for i, p in enumerate(prompts)
        for s in range(args.samples)
    ]
    drain(engine)
    return {
        "wall_s": time.perf_counter() - start,
        "ttft_ms": statistics.mean(ttft_ms(r) for r in requests),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "cached_tokens": sum(r.num_cached_tokens for r in requests),
        "outputs": [r.output_token_ids for r in requests],
    }


def run_turns(engine: Engine, args, rnd: int) -> dict:
    items = load_prompts("mtbench", chat=True)[: args.turns]
    second = [t["turns"][1] for t in _mtbench_items()[: args.turns]]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    start = time.perf_counter()
    ttfts, outputs, prompt_tokens, cached = [], [], 0, 0
    for messages, follow in zip(items, second):
        first = engine.add_request(messages, greedy)
        drain(engine)
        conversation = [*messages, {"role": "assistant", "content": first.output_text}]
        again = engine.add_request([*conversation, {"role": "user", "content": follow}], greedy)
        drain(engine)
        ttfts.append(ttft_ms(again))
        outputs += [first.output_token_ids, again.output_token_ids]
        prompt_tokens += len(again.prompt_token_ids)
        cached += again.num_cached_tokens
    return {
        "wall_s": time.perf_counter() - start,
        "ttft_ms": statistics.mean(ttfts),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "outputs": outputs,
    }


def run_document(engine: Engine, args, rnd: int) -> dict:
    text = "\n".join(load_prompts("humaneval", chat=False))
    doc = engine.tokenizer.decode(engine.tokenizer.encode(text)[: args.doc_tokens])
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    start = time.perf_counter()
    ttfts, outputs, prompt_tokens, cached = [], [], 0, 0
    for q in QUESTIONS[: args.questions]:
        r = engine.add_request([{"role": "user", "content": f"{doc}\n\nQuestion: {q}"}], greedy)
        drain(engine)
        ttfts.append(ttft_ms(r))
        outputs.append(r.output_token_ids)
        prompt_tokens += len(r.prompt_token_ids)
        cached += r.num_cached_tokens
    return {
        "wall_s": time.perf_counter() - start,
        "ttft_ms": statistics.mean(ttfts),
        "first_ttft_ms": ttfts[0],
        "later_ttft_ms": statistics.mean(ttfts[1:]) if len(ttfts) > 1 else None,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "outputs": outputs,
    }


def _mtbench_items() -> list[dict]:
    return [json.loads(line) for line in BUILTIN["mtbench"].read_text().splitlines() if line.strip()]


WORKLOADS = {"grpo": run_grpo, "turns": run_turns, "document": run_document}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--workloads", default="grpo,turns,document")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--grpo-prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--doc-tokens", type=int, default=1500)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or not workloads:
        raise SystemExit(f"--workloads: any of {', '.join(WORKLOADS)}; got {args.workloads!r}")
    engines = {
        name: Engine(
            EngineConfig(
                model=args.model,
                max_num_seqs=max(32, args.grpo_prompts * args.samples),
                kv_cache_memory_gb=2.0,
                enable_prefix_caching=on,
                progress=False,
            )
        )
        for name, on in (("on", True), ("off", False))
    }
    for engine in engines.values():  # first-call overheads off the clock
        engine.add_request("Hello", SamplingParams(max_tokens=2, temperature=0.0))
        drain(engine)
    runs: list[dict] = []
    for rnd in range(args.rounds):
        for workload in workloads:
            order = ["on", "off"] if rnd % 2 == 0 else ["off", "on"]
            pair = {}
            for name in order:
                engines[name].reset_prefix_cache()
                pair[name] = WORKLOADS[workload](engines[name], args, rnd)
                print(f"round {rnd} {workload} {name}: {pair[name]['wall_s']:.1f} s", flush=True)
            same = pair["on"].pop("outputs") == pair["off"].pop("outputs")
            runs.append({"round": rnd, "workload": workload, "same_outputs": same, **pair})
    rows = []
    for workload in workloads:
        mine = [r for r in runs if r["workload"] == workload]
        wall = [r["on"]["wall_s"] / r["off"]["wall_s"] for r in mine]
        ttft = [r["on"]["ttft_ms"] / r["off"]["ttft_ms"] for r in mine]
        rows.append(
            [
                workload,
                " / ".join(f"{r['off']['wall_s']:.1f}" for r in mine),
                " / ".join(f"{r['on']['wall_s']:.1f}" for r in mine),
                " / ".join(f"{x:.2f}" for x in wall),
                " / ".join(f"{r['off']['ttft_ms']:.0f}" for r in mine),
                " / ".join(f"{r['on']['ttft_ms']:.0f}" for r in mine),
                " / ".join(f"{x:.2f}" for x in ttft),
                f"{mine[0]['on']['cached_tokens']} of {mine[0]['on']['prompt_tokens']}",
                "yes" if all(r["same_outputs"] for r in mine) else "NO",
            ]
        )
    print(
        format_table(
            [
                "workload",
                "off wall s",
                "on wall s",
                "on / off",
                "off TTFT ms",
                "on TTFT ms",
                "on / off",
                "cached prompt tokens",
                "same outputs",
            ],
            rows,
        )
    )
    write_result(
        args.out,
        {"probe": "prefix_cache_ab", "args": vars(args), "runs": runs, "environment": environment()},
    )


if __name__ == "__main__":
    main()
