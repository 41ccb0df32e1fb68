"""How often confidence stops cut the drafts the K policy asks for (`git show e12b4e2:results/RESULTS.md`,
"The decoder stack as one call"): the pair (drafter head cut to 32768 ids) with per-request K on its
HumanEval profile, six HumanEval prompts sampled at temperature 1.0 to 200..700 tokens (EOS ignored), so
the batch drains from 6 to 1. Per running batch size: draft positions asked (``k_caps``), proposed
(``draft_lens``, after stops) and accepted, and the acceptance per proposed and per asked position.

    .venv/bin/python benchmarks/probes/draft_stops.py \
        [--profile results/zen4/profile_qwen_pair_humaneval_7.json]
"""

from __future__ import annotations

import argparse
import collections

from dynaspec import SamplingParams
from dynaspec.datasets import load_prompts
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.kpolicy import goodput

LENGTHS = (200, 300, 400, 500, 600, 700)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--profile",
        default="results/zen4/profile_qwen_pair_humaneval_7.json",
        help="the pair's profile (the figure's, zen4's profile_qwen_pair_humaneval_4.json, is in history)",
    )
    args = p.parse_args()
    counts = collections.defaultdict(lambda: [0, 0, 0, 0])  # steps, asked, proposed, accepted
    observe = goodput.GoodputK.observe

    def counting(self, record):
        result = record.result
        if result.draft_lens:
            c = counts[len(record.plan.decodes)]
            c[0] += 1
            c[1] += sum(record.plan.k_caps)
            c[2] += sum(result.draft_lens)
            c[3] += sum(result.num_accepted)
        return observe(self, record)

    goodput.GoodputK.observe = counting
    spec = {
        "method": "draft_model",
        "model": "qwen2.5-coder-0.5b-instruct",
        "draft_vocab_size": 32768,
        "num_speculative_tokens": 5,
        "dynamic_config_path": args.profile,
    }
    config = EngineConfig(model="qwen2.5-coder-1.5b-instruct", speculative_config=spec, progress=False)
    engine = Engine(config)
    for i, (prompt, n) in enumerate(zip(load_prompts("humaneval", chat=True), LENGTHS)):
        ids = engine.tokenizer.apply_chat_template(prompt)
        engine.add_request(ids, SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    for bs in sorted(counts):
        steps, asked, proposed, accepted = counts[bs]
        if not asked:
            print(f"bs {bs}: steps {steps}, no drafts asked")
            continue
        print(
            f"bs {bs}: steps {steps}, asked {asked}, proposed {proposed} ({proposed / asked:.2f}), accepted "
            f"{accepted} (per proposed {accepted / max(proposed, 1):.2f}, per asked {accepted / asked:.2f})"
        )
    snapshot = engine.k_policy.snapshot()
    print("confidence threshold at the end", snapshot["min_draft_confidence"])
    print("acceptance estimate per position", snapshot["acceptance_rate_per_pos"])


if __name__ == "__main__":
    main()
