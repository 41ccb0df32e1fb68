"""One engine step of 8 HumanEval requests with drafts given per request (`git show
e12b4e2:results/RESULTS.md`, "The n-gram grid"): n-gram rows filled to their K, each assignment timed 3
times in each of 3 rounds, median step and target pass. A step's window is as wide as its longest draft, so
with a K per request it is mostly padding; this shows what the padding costs beside the target's pass.

    .venv/bin/python benchmarks/probes/ragged_step.py                                              # (~1 min)
"""

import argparse
import statistics
import time

from dynaspec.datasets import load_prompts
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.engine.profiler import filled_drafts
from dynaspec.kpolicy.policy import FixedK
from dynaspec.sampling_params import SamplingParams

CASES = {
    "none": [0] * 8,
    "one K=1": [1] + [0] * 7,
    "one K=5": [5] + [0] * 7,
    "all K=1": [1] * 8,
    "all K=2": [2] * 8,
    "half K=5": [5] * 4 + [0] * 4,
    "K=5, 1 x7": [5] + [1] * 7,
}


class Given(FixedK):
    """These drafts, whatever the load."""

    def __init__(self, drafts: list[int]) -> None:
        super().__init__(max(drafts))
        self.drafts = drafts

    def choose(self, candidates):
        drafts = [self.drafts[i] if c.decoding else 0 for i, c in enumerate(candidates)]
        return max(drafts), drafts


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    engine = Engine(
        EngineConfig(
            model="qwen2.5-coder-1.5b-instruct",
            speculative_config={"method": "ngram", "num_speculative_tokens": 5},
            progress=False,
        )
    )
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in load_prompts("humaneval", chat=True)[:8]]
    engine.set_k_policy(FixedK(0))
    while not all(r.is_decoding for r in requests):
        engine.step()
    steps: dict[str, list[float]] = {name: [] for name in CASES}
    target: dict[str, list[float]] = {name: [] for name in CASES}
    with filled_drafts(engine):
        for _ in range(3):
            for name, drafts in CASES.items():
                engine.set_k_policy(Given(drafts))
                engine.step()  # warm-up
                for _ in range(3):
                    with engine.recording() as run:
                        start = time.perf_counter()
                        engine.step()
                        steps[name].append((time.perf_counter() - start) * 1000)
                    target[name].append(run.timings[-1].target_ms)
    print(f"{'drafts':<10} {'rows':>4} {'step ms':>8} {'target ms':>9} {'rest ms':>8}")
    for name, drafts in CASES.items():
        step, tgt = statistics.median(steps[name]), statistics.median(target[name])
        print(f"{name:<10} {8 + sum(drafts):>4} {step:>8.1f} {tgt:>9.1f} {step - tgt:>8.1f}")


if __name__ == "__main__":
    main()
