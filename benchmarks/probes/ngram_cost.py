"""The n-gram proposer's host time a request a step: the match offered to the K policy
(``NgramProposer.free_rates``, which ``propose`` then reuses), on a request growing one token a
step over prompts of several lengths (random tokens from a vocabulary of ``--vocab``: a frequent
last token leaves more candidate matches to extend).

    .venv/bin/python benchmarks/probes/ngram_cost.py --out ngram_cost.json   # seconds
"""

import argparse
import json
import time
from types import SimpleNamespace

import numpy as np

from dynaspec.spec_decode.ngram import NgramProposer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="256,2048,4096,16384")
    p.add_argument("--vocab", default="2000,50", help="vocabulary sizes of the random tokens")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    spec = SimpleNamespace(prompt_lookup_min=2, prompt_lookup_max=4, num_speculative_tokens=5)
    rng = np.random.default_rng(0)
    rows = []
    for vocab in map(int, args.vocab.split(",")):
        for context in map(int, args.contexts.split(",")):
            proposer = NgramProposer(spec, SimpleNamespace(device="cpu"))
            prompt = rng.integers(0, vocab, context).tolist()
            request = SimpleNamespace(
                request_id="r", prompt_token_ids=prompt, output_token_ids=[], num_tokens=context
            )
            proposer.free_rates(request)  # the first sight builds its array
            start = time.perf_counter()
            for _ in range(args.steps):
                request.output_token_ids.append(int(rng.integers(0, vocab)))
                request.num_tokens += 1
                proposer.free_rates(request)
            ms = (time.perf_counter() - start) / args.steps * 1e3
            rows.append({"vocab": vocab, "context": context, "ms_per_request_step": round(ms, 4)})
            print(f"vocabulary {vocab:5d}, context {context:6d}: {ms:.4f} ms a request a step")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
