"""Per-step trace of the K a policy gives and the drafts it gets (`git show e12b4e2:results/RESULTS.md`,
"Cross-dataset, the other way"): the pair with the MT-Bench profile on HumanEval prompts in a closed loop,
configs side by side in rounds (ABBA), every step's `k_caps` and draft lengths recorded.

    .venv/bin/python benchmarks/probes/trace_k.py      # C=2, 10 prompts, greedy, K=3 and per-request (~2 min)
    .venv/bin/python benchmarks/probes/trace_k.py --concurrency 1 --prompts 8 --temperature 1.0 --rounds 2 \
        --configs K=5,goodput,per-request,per-request-conf0                                   # (~8 min)
    .venv/bin/python benchmarks/probes/trace_k.py \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 5}' \
        --profile results/profile_ngram_auto.json --dataset mixed --concurrency 8 --prompts 64 \
        --configs goodput,per-request                                                       # (~5 min)

A draft length below its cap is a confidence stop (or a draft cut at the request's last tokens)."""

import argparse
import json
import time
from collections import Counter

from dynaspec.bench.common import k_policies
from dynaspec.datasets import load_prompts
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.kpolicy.goodput import GoodputK
from dynaspec.kpolicy.profile import load_profile
from dynaspec.sampling_params import SamplingParams

SPEC = {
    "method": "draft_model",
    "model": "qwen2.5-coder-0.5b-instruct",
    "draft_vocab_size": 32768,
    "num_speculative_tokens": 5,
}


def policies(profile, names: list[str]) -> dict:
    """The configurations by name, as the benchmarks define them (`k_policies`: K=k, goodput, the
    batch-level rule without confidence stops, and per-request), and per-request-conf0 (per-request
    K without confidence stops)."""
    fixed = [int(n.removeprefix("K=")) for n in names if n.startswith("K=")]
    makers = k_policies(fixed, profile, 5, 3)
    makers["per-request-conf0"] = lambda: GoodputK(profile, 5, 3, per_request=True, min_confidence=0.0)
    unknown = [n for n in names if n not in makers]
    if unknown:
        raise SystemExit(f"--configs: unknown {', '.join(unknown)} (choose from {', '.join(makers)})")
    return makers


def run_round(engine, policy, prompts, args, seed_base: int, plans: list, t: dict) -> None:
    """One closed loop of ``args.concurrency`` over ``prompts`` with ``policy``, adding to ``t``."""
    engine.set_k_policy(policy)
    observe = policy.observe

    def spy(record) -> None:  # each decode's draft length against its cap
        t["drafts"].update(zip(record.plan.k_caps, record.result.draft_lens))
        observe(record)

    policy.observe = spy
    queued = list(enumerate(prompts))

    def submit() -> None:
        i, prompt = queued.pop(0)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=seed_base + i)
        engine.add_request(prompt, params)

    for _ in range(min(args.concurrency, len(queued))):
        submit()
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        planned = len(plans)
        outputs = engine.step()
        if len(plans) > planned:
            t["steps"] += 1
            t["caps"][tuple(plans[-1].k_caps)] += 1
        for o in outputs:
            if o.finished:  # the closed loop: a finished request is replaced
                tokens += len(o.output_token_ids)
                if queued:
                    submit()
    wall = time.perf_counter() - start
    t["wall"] += wall
    t["tokens"] += tokens
    t["probes"] += policy.snapshot().get("probes", 0)
    print(f"  {tokens / wall:.2f} tok/s ({tokens} tokens, {wall:.1f} s)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="results/xeon/profile_qwen_pair_mtbench.json")
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--configs", default="K=3,per-request", help="K=k, goodput, per-request(-conf0)")
    p.add_argument("--speculative-config", default=json.dumps(SPEC), help="the engine's (default: the pair)")
    args = p.parse_args()

    engine = Engine(
        EngineConfig(model="qwen2.5-coder-1.5b-instruct", speculative_config=args.speculative_config)
    )
    names = args.configs.split(",")
    makers = policies(load_profile(args.profile), names)
    prompts = load_prompts(args.dataset, chat=True)[: args.prompts]
    plans = []  # every step's plan, recorded as the scheduler makes it
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda policy: plans.append(schedule(policy)) or plans[-1]
    totals = {
        n: {"wall": 0.0, "tokens": 0, "caps": Counter(), "drafts": Counter(), "steps": 0, "probes": 0}
        for n in names
    }
    for rnd in range(args.rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            print(f"round {rnd} {name}:", end="", flush=True)
            run_round(engine, makers[name](), prompts, args, rnd * 1000, plans, totals[name])
    for name in names:
        t = totals[name]
        print(
            f"{name}: {t['tokens'] / t['wall']:.2f} tok/s over {t['wall']:.1f} s, {t['steps']} steps, "
            f"{t['probes']} probes"
        )
        print("  K caps per step (most common):", t["caps"].most_common(6))
        rows = sum(t["drafts"].values())
        cut = sum(n for (cap, drafted), n in t["drafts"].items() if drafted < cap)
        lengths = Counter()
        for (_, drafted), n in t["drafts"].items():
            lengths[drafted] += n
        print(f"  decode rows {rows}, drafted below their cap {cut}; draft lengths:", sorted(lengths.items()))


if __name__ == "__main__":
    main()
