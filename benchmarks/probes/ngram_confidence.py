"""What the target accepts of n-gram drafts, by the match: the first draft positions' acceptance
against the matched n-gram's length and whether the n-gram's occurrence before the one continued
went on with the same token (the features of ``spec_decode.ngram.match_confidence``).

The target's greedy answers are generated once (plain decoding, ``--concurrency`` at a time); then
at every output position the lookup runs on the context so far, as the n-gram proposer would, and
its draft is checked against the answer's next tokens. Prints a table per dataset and writes JSON.

    .venv/bin/python benchmarks/probes/ngram_confidence.py --prompts 32 --out ngram_confidence.json  # ~2 min
"""

import argparse
import json
from collections import defaultdict

import numpy as np

from dynaspec.bench.sweep import closed_loop
from dynaspec.datasets import load_prompts
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.sampling_params import SamplingParams
from dynaspec.spec_decode.ngram import ngram_match


def answers(engine: Engine, prompts: list, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    _, requests, _ = closed_loop(
        engine, prompts, len(prompts), SamplingParams(max_tokens=max_tokens, temperature=0.0)
    )
    return [(list(r.prompt_token_ids), list(r.output_token_ids)) for r in requests]


def tabulate(pairs, n_min: int, n_max: int, k: int) -> dict[str, dict]:
    """Reached and accepted draft tokens by (position, n, previous occurrence: agreed, differed or
    none); position 2 stands for 2 and beyond."""
    table: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for prompt, output in pairs:
        tokens = np.array(prompt + output)
        for t in range(1, len(output) - 1):
            context = tokens[: len(prompt) + t]
            match = ngram_match(context, n_min, n_max)  # what ngram_draft drafts from
            if match is None:
                continue
            n, start, before = match
            draft = context[start : start + k].tolist()
            for j, (drafted, truth) in enumerate(zip(draft, output[t : t + k])):
                if before is None:
                    kind = "single"
                elif before + j < len(context) and context[before + j] == drafted:
                    kind = "agreed"
                else:
                    kind = "differed"
                cell = table[(min(j, 2), n, kind)]
                cell[0] += 1
                cell[1] += drafted == truth
                if drafted != truth:
                    break
    return {
        f"pos{j} n={n} {kind}": {"reached": r, "accepted": round(a / r, 3)}
        for (j, n, kind), (r, a) in sorted(table.items())
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", default="mtbench,humaneval")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    engine = Engine(EngineConfig(model="qwen2.5-coder-1.5b-instruct"))
    report = {"args": vars(args), "datasets": {}}
    for dataset in args.datasets.split(","):
        pairs = answers(engine, load_prompts(dataset, chat=True)[: args.prompts], args.max_tokens)
        table = tabulate(pairs, args.prompt_lookup_min, args.prompt_lookup_max, args.k)
        report["datasets"][dataset] = table
        print(dataset)
        for key, cell in table.items():
            if cell["reached"] >= 5:
                print(f"  {key:22s} reached {cell['reached']:5d}  accepted {cell['accepted']:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
